"""`engine.bench.decode_steps` on the sim device: token times, and per-kind breakdowns of early and late
traced steps."""

from __future__ import annotations

import gzip
import json

from engine.bench import decode_steps
from engine.bench.trace_breakdown import breakdown


def test_decode_steps_reports_tokens_and_traces(tmp_path):
    assert decode_steps.main(["--shape", "tiny-llama", "--device", "sim", "--budgets", "2MiB", "--tokens", "5",
                              "--late-token", "6", "--profile-steps", "2", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "decode_steps.json").read_text())
    row = rep["rows"][0]
    assert len(row["token_ms"]) == 4 and all(t > 0 for t in row["token_ms"])
    assert row["predicted_ms"] > 0
    for when in ("early", "late"):
        kinds = row[f"trace_{when}"]["kinds"]
        # every sub-layer of two steps ran under a labelled range: 2 layers' attn + ffn, embed, head
        assert sum(k["n"] for k in kinds.values()) == 2 * (2 * 2 + 2)
        with gzip.open(tmp_path / row[f"trace_{when}"]["trace"], "rt") as f:
            assert breakdown(json.load(f)["traceEvents"])["kinds"].keys() == kinds.keys()


def test_decode_steps_traces_a_prefill(tmp_path):
    assert decode_steps.main(["--shape", "tiny-llama", "--device", "sim", "--budgets", "2MiB", "--tokens", "3",
                              "--no-decode-traces", "--prefill-trace", "40", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "decode_steps.json").read_text())["rows"][0]
    assert "trace_early" not in row and "trace_late" not in row
    pre = row["prefill_trace"]
    assert pre["tokens"] == 40 and pre["traced_ms"] > 0
    # one step over the whole prompt: each of the 2 layers' attn and ffn, embed and head once
    assert sum(k["n"] for k in pre["kinds"].values()) == 2 * 2 + 2
    assert (tmp_path / pre["trace"]).is_file()
