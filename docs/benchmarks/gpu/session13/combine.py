"""How session 13 assembled gpu/issue6/part-slipstream.json and part-llamacpp.json from its calls.

- Slipstream: the Llama-3-8B rows at 2 and 8 GiB of call AA (before activations crossed through pinned
  memory), its 4 GiB row of call CC (after); the Qwen3-30B-A3B rows of calls CC (2, 4 GiB) and BB8 (8 GiB),
  on the weights whose routing spreads (call AA's MoE rows, on the old weights, stay in gpu/session13/callaa).
- llama.cpp: call BB's part: the dense rows as before, the MoE rows at 2 and 4 GiB again on the new GGUF
  (call BB8 built llama.cpp again but reached its deadline before the 8 GiB runs: nothing new).

    python docs/benchmarks/gpu/session13/combine.py
"""
import json
import time
from pathlib import Path

S13 = Path(__file__).parent
ISSUE6 = S13.parent / "issue6"


def load(p):
    return json.loads(Path(p).read_text())


aa = load(S13 / "callaa/x/suite/part-slipstream.json")
cc = load(S13 / "callcc/x/suite/part-slipstream.json")
cc_llama = load(S13 / "callcc/x/suite-llama/part-slipstream.json")
moe8_path = S13 / "callbb8/part-slipstream-moe8.json"
moe8 = load(moe8_path) if moe8_path.is_file() else None

rows = [dict(r, call="AA") for r in aa["rows"] if r["model"] == "llama3-8b" and r["budget"] != "4GiB"]
rows += [dict(r, call="CC") for r in cc_llama["rows"]]
rows += [dict(r, call="CC") for r in cc["rows"]]
if moe8:
    rows += [dict(r, call="BB8") for r in moe8["rows"]]
out = dict(aa)
out["rows"] = rows
meta = dict(cc["meta"])
sources = [aa, cc, cc_llama] + ([moe8] if moe8 else [])
meta["commands"] = [c for d in sources for c in d["meta"].get("commands", [])]
meta["lease_probes"] = [p for d in sources for p in d["meta"].get("lease_probes", [])]
meta["weights"] = "random_std"     # (calls CC and BB8 ran the new weights; AA's dense rows do not depend on them)
meta["assembled"] = "docs/benchmarks/gpu/session13/combine.py"
out["meta"] = meta
out["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
(ISSUE6 / "part-slipstream.json").write_text(json.dumps(out, indent=1) + "\n")

llama_path = S13 / "callbb/part-llamacpp.json"
lc = load(llama_path)
lc["meta"]["weights"] = "random_std"   # (its MoE rows: the GGUF facts list the new deviations)
lc["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
(ISSUE6 / "part-llamacpp.json").write_text(json.dumps(lc, indent=1) + "\n")
print(f"slipstream rows {len(rows)}; llama.cpp from {llama_path.parent.name}: {len(lc['rows'])} rows")
