"""VAE encoder variants at 512 px bf16: images/s and max error vs the current WorldEncoder."""
import json, sys, time, os
import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from theworld.encoders import WorldEncoder

dev = torch.device("cuda")
torch.manual_seed(0)
vae = AutoencoderKLWan().to(dev, torch.bfloat16).eval()
enc = WorldEncoder(vae)

def direct(x):  # no temporal feature cache: a single frame never reads it
    h = vae.encoder(enc.to_unit_range(x).to(torch.bfloat16).unsqueeze(2))
    p = DiagonalGaussianDistribution(vae.quant_conv(h))
    return p.mean, p.logvar

def timeit(fn, x, steps=6):
    with torch.no_grad():
        out = fn(x); fn(x)
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(steps):
            fn(x)
        torch.cuda.synchronize()
    return x.shape[0] * steps / (time.perf_counter() - t), out

def err(a, b):
    return max((a[0].float() - b[0].float()).abs().max().item(), (a[1].float() - b[1].float()).abs().max().item())

rows = []
def row(name, fn, B, x, ref):
    try:
        t0 = time.perf_counter()
        ips, out = timeit(fn, x)
        r = {"variant": name, "batch": B, "images_per_s": round(ips, 1), "max_err": round(err(out, ref), 5),
             "ref_scale": round(ref[0].float().abs().max().item(), 3), "wall_s": round(time.perf_counter() - t0, 1),
             "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}
    except Exception as e:
        r = {"variant": name, "batch": B, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(json.dumps(r), flush=True); rows.append(r)

g = torch.Generator().manual_seed(0)
# smooth-ish images: low-res noise upsampled, so activations look more like photos than white noise
xs = {B: (torch.nn.functional.interpolate(torch.rand(B, 3, 64, 64, generator=g), size=512, mode="bilinear") * 255).to(torch.uint8).to(dev) for B in (16, 32)}
refs = {}
for B in (16, 32):
    with torch.no_grad():
        refs[B] = enc(xs[B])
row("direct", direct, 32, xs[32], refs[32])
def set_format(cl):
    for p in vae.parameters():
        if p.dim() in (4, 5):
            p.data = p.data.contiguous(memory_format=(torch.channels_last if p.dim() == 4 else torch.channels_last_3d) if cl else torch.contiguous_format)
set_format(True)
def direct_cl(x):
    x = enc.to_unit_range(x).to(torch.bfloat16).unsqueeze(2).contiguous(memory_format=torch.channels_last_3d)
    p = DiagonalGaussianDistribution(vae.quant_conv(vae.encoder(x)))
    return p.mean, p.logvar
row("direct+channels_last", direct_cl, 32, xs[32], refs[32])
row("direct+channels_last", direct_cl, 16, xs[16], refs[16])
vae.encoder.compile()
row("direct+channels_last+compile", direct_cl, 32, xs[32], refs[32])
row("direct+channels_last+compile", direct_cl, 16, xs[16], refs[16])
set_format(False)
torch._dynamo.reset()
row("direct+compile", direct, 32, xs[32], refs[32])
row("direct+compile", direct, 16, xs[16], refs[16])
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "exp_vae.json"), "w"), indent=1)
