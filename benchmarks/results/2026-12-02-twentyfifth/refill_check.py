import json, sys, torch
sys.path.insert(0, "/work/main")
from tests.conftest import replay_logprobs, refill_points
f = sys.argv[1]
d = json.load(open(f)); blob = torch.load(f + ".pt", weights_only=False)
prompt = blob["prompt"]; model = f + ".model"
print("pieces", d["pieces"])
pts = refill_points(d["pieces"], len(prompt), d["block"]); print("points", pts)
lps = torch.tensor(d["lps"])
for refilled in [(), tuple(pts)]:
    r = replay_logprobs(model, blob["states"], prompt, d["ids"], d["versions"], pieces=d["pieces"], refilled=refilled)
    e = (r - lps).abs()
    print(refilled, "max", e.max().item(), "at", int(e.argmax()), "n>1e-4", int((e > 1e-4).sum()))
