"""Flex attention vs SDPA at real size: loss and projector gradient on the same batch (eager)."""
import json, torch
from train import bench_real as br
from theworld.encoders import _quiet_hf
_quiet_hf()
dev = torch.device("cuda")
g = br.build_gemma(br.REAL, dev, "sdpa")
m = br.build(br.REAL, g, 2, dev); m.train()
x = br.batch(br.REAL, 2, dev)
x["attention_mask"][1, -7:] = 0
res = {}
for attn in ("sdpa", "flex_attention"):
    g.set_attn_implementation(attn)
    m.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = m(**x)
    out.loss.backward()
    res[attn] = (out.loss.item(), torch.cat([p.grad.flatten() for p in m.projector.parameters()]).float())
a, b = res["sdpa"], res["flex_attention"]
print(json.dumps({"loss_sdpa": a[0], "loss_flex": b[0], "grad_rel_err": ((a[1] - b[1]).norm() / a[1].norm()).item()}))
