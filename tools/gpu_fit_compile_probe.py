"""fit(compile=True) on a timm model on CUDA, bf16 autocast, channels_last: the compiled
step's peak (torch.cuda.max_memory_allocated above what lived before the model) and time
without memlean, with torch.compile's activation_memory_budget=0.5, and fitted with
compile=True at that peak. JSON lines to stdout and OUT/fit_compile_cuda.jsonl."""
import gc, json, os, sys, time
import torch, timm
import memlean

OUT = sys.argv[1]
NAME = os.environ.get("MODEL", "resnet18")
BATCH = int(os.environ.get("BATCH", "128"))
f = open(os.path.join(OUT, "fit_compile_cuda.jsonl"), "a")


def emit(**row):
    print(json.dumps(row), flush=True)
    f.write(json.dumps(row) + "\n"); f.flush()


def region():
    return torch.autocast("cuda", torch.bfloat16)


def loss_fn(out):
    return out.float().square().mean()


def make():
    torch.manual_seed(0)
    m = timm.create_model(NAME, num_classes=1000).cuda().to(memory_format=torch.channels_last)
    x = torch.randn(BATCH, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    return m, x, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)


def step(f_, model, x, opt):
    for p in model.parameters():
        p.grad = None
    gc.collect(); torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with region():
        loss_fn(f_(x)).backward()
    opt.step(); opt.zero_grad(set_to_none=True)
    torch.clear_autocast_cache(); torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), time.perf_counter() - t0


def compiled_run(model, x, opt, base, **config):
    torch._dynamo.reset()
    t0 = time.perf_counter()
    with torch._functorch.config.patch(**config):
        c = torch.compile(model, dynamic=False)
        step(c, model, x, opt)
        compile_s = time.perf_counter() - t0
        res = [step(c, model, x, opt) for _ in range(5)]
    torch._dynamo.reset()
    return max(r[0] for r in res) - base, sorted(r[1] for r in res)[2], compile_s


emit(device=torch.cuda.get_device_name(), torch=torch.__version__, model=NAME, batch=BATCH)
model, x, opt = make()
step(model, model, x, opt)
with region():
    loss_fn(memlean.checkpoint(model, x)).backward()
del model, x, opt
gc.collect(); torch.cuda.synchronize()
base = torch.cuda.memory_allocated()
model, x, opt = make()
peak, t, cs = compiled_run(model, x, opt, base)
emit(method="compile", peak=peak, step_ms=round(t * 1e3, 2), compile_s=round(cs, 1))
peak5, t5, cs = compiled_run(model, x, opt, base, activation_memory_budget=0.5)
emit(method="compile, activation_memory_budget 0.5", peak=peak5, step_ms=round(t5 * 1e3, 2),
     compile_s=round(cs, 1))
t0 = time.perf_counter()
with region():
    plan = memlean.fit(model, x, peak5, loss_fn=loss_fn, optimizer=opt, compile=True)
fit_s = time.perf_counter() - t0
print(plan, flush=True)
pk, tk, cs = compiled_run(model, x, opt, base)
emit(method="memlean.fit(compile=True) at compile-0.5's peak", budget=peak5, peak=pk,
     fit_peak=plan.peak_bytes, within=pk <= peak5, step_ms=round(tk * 1e3, 2),
     vs_compile05=round(tk / t5, 3), fit_s=round(fit_s, 1), actions=len(plan.actions),
     checkpoints_traced=sorted({getattr(m.forward, "__memlean_traced__", None)
                                for m in model.modules()} - {None}))
