#!/bin/bash
# Session 18, call A: ran gpu/session17/callcc.sh as it is (copied into carry/ with the profiles it names):
#   bash carry/callcc.sh
