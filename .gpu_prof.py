"""Throughput probe of one pretraining step of a saved model (GPU diagnostics, not committed)."""
import sys, time, torch
from transformers import AutoModelForCausalLM
from lorapop.tiny.pretrain import example_weighted_loss
M = sys.argv[1]
dev = torch.device("cuda")
model = AutoModelForCausalLM.from_pretrained(M, dtype=torch.float32).to(dev).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
g = torch.Generator(device=dev).manual_seed(0)
def batch(rows, width):
    ids = torch.randint(3, 2000, (rows, width), device=dev, generator=g)
    labels = ids.clone(); labels[:, : width * 2 // 3] = -100
    return ids, labels
def step(m, ids, labels, weighted):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if weighted:
            loss = example_weighted_loss(m(input_ids=ids, use_cache=False).logits, labels, 0.5)
        else:
            loss = m(input_ids=ids, labels=labels, use_cache=False).loss
    opt.zero_grad(set_to_none=True); loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()
def timed(name, m, weighted, shapes, n=12):
    for r, w in shapes[:2]:
        step(m, *batch(r, w), weighted)
    torch.cuda.synchronize(); t = time.perf_counter()
    for i in range(n):
        r, w = shapes[i % len(shapes)]
        step(m, *batch(r, w), weighted)
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / n
    print(f"{name}: {1000 * dt:.1f} ms/step, {81920 / dt / 1e6:.2f} M padded tokens/s", flush=True)
shapes = [(256, 320), (640, 128), (80, 1024), (160, 512)]
timed("eager hf-loss", model, False, shapes)
timed("eager weighted", model, True, shapes)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    for i in range(4):
        step(model, *batch(256, 320), True)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
t = time.perf_counter()
cm = torch.compile(model, dynamic=True)
timed("compiled(dynamic) weighted [incl. warm-up below]", cm, True, shapes)
print(f"compile+run wall {time.perf_counter() - t:.1f}s", flush=True)
timed("compiled(dynamic) weighted, warm", cm, True, shapes)
