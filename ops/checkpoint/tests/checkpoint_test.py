"""memlean.checkpoint, memlean.CheckpointFunction (pytorch-checkpoint's call form,
docs/sources.md), memlean.checkpoint_sequential, the planner and memlean.BatchNorm2d through
the Python package. The DDP test is checkpoint_ddp_test.py."""
import copy
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memlean
import memlean.memstats

D = torch.float64


def grads(tensors):
    """The gradients of `tensors` (None where there is none), then cleared."""
    out = []
    for t in tensors:
        out.append(None if t.grad is None else t.grad.clone())
        t.grad = None
    return out


def assert_same(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x is None) == (y is None), i
        if x is not None:
            assert torch.equal(x, y), f"tensor {i}: max diff {(x - y).abs().max()}"


class Block(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.norm = memlean.BatchNorm2d(c)
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return self.conv(F.relu(self.norm(x)))


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return Block(**kw).to(D)


# ---- gradients ---------------------------------------------------------------------------


def test_gradients_equal_the_plain_function_in_float64():
    torch.manual_seed(0)
    w, b = torch.randn(8, 8, dtype=D, requires_grad=True), torch.randn(8, dtype=D, requires_grad=True)
    x = torch.randn(5, 8, dtype=D, requires_grad=True)

    def f(t):
        return torch.tanh(F.linear(t, w, b)) * t

    f(x).pow(2).sum().backward()
    plain = grads([x, w, b])
    y = memlean.checkpoint(f, x, params=[w, b])
    assert y.requires_grad
    y.pow(2).sum().backward()
    assert_same(grads([x, w, b]), plain)
    memlean.CheckpointFunction.apply(f, 1, x, w, b).pow(2).sum().backward()
    assert_same(grads([x, w, b]), plain)
    assert torch.autograd.gradcheck(lambda t, w_, b_: memlean.CheckpointFunction.apply(
        lambda u: torch.tanh(F.linear(u, w_, b_)) * u, 1, t, w_, b_), (x, w, b))


def test_module_form_and_its_parameters():
    plain, ckpt = make(), make()
    x = torch.randn(3, 4, 6, 6, dtype=D, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    plain(x).pow(2).sum().backward()
    memlean.checkpoint(ckpt, x2).pow(2).sum().backward()
    assert_same([x2.grad] + [p.grad for p in ckpt.parameters()],
                [x.grad] + [p.grad for p in plain.parameters()])
    assert_same(list(ckpt.buffers()), list(plain.buffers()))


def test_several_inputs_and_outputs_non_tensors_and_structures():
    torch.manual_seed(1)
    lin = nn.Linear(6, 6).to(D)
    x = torch.randn(4, 6, dtype=D, requires_grad=True)
    h = torch.randn(4, 6, dtype=D)  # does not require grad

    def f(a, b, scale, mode, nothing):
        assert mode == "sum" and nothing is None
        y = lin(a) * scale + b
        return {"y": y, "count": 3, "parts": [y.sum(1), y.argmax(1)], "name": mode}

    out = f(x, h, 2.5, "sum", None)
    (out["y"].sum() + out["parts"][0].pow(2).sum()).backward()
    plain = grads([x, lin.weight, lin.bias])
    out = memlean.checkpoint(f, x, h, 2.5, "sum", None, params=list(lin.parameters()))
    assert out["count"] == 3 and out["name"] == "sum"
    assert out["parts"][1].dtype == torch.int64 and not out["parts"][1].requires_grad
    (out["y"].sum() + out["parts"][0].pow(2).sum()).backward()
    assert_same(grads([x, lin.weight, lin.bias]), plain)
    assert h.grad is None


def test_inputs_that_do_not_require_grad():
    plain, ckpt = make(), make()
    x = torch.randn(3, 4, 5, 5, dtype=D)
    plain(x).sum().backward()
    memlean.checkpoint(ckpt, x).sum().backward()
    assert_same([p.grad for p in ckpt.parameters()], [p.grad for p in plain.parameters()])


def test_without_grad_it_is_a_plain_call():
    calls = []
    block = make()
    x = torch.randn(2, 4, 5, 5, dtype=D, requires_grad=True)

    def f(t):
        calls.append(memlean.is_recomputing())
        return block(t)

    with torch.no_grad():
        y = memlean.checkpoint(f, x, params=list(block.parameters()))
    assert not y.requires_grad and calls == [False]
    # A train-mode forward under no_grad updates the statistics.
    assert block.norm.num_batches_tracked.item() == 1


def test_recompute_flag_and_nested_checkpoints():
    torch.manual_seed(2)
    inner, outer = nn.Linear(5, 5).to(D), nn.Linear(5, 5).to(D)
    x = torch.randn(3, 5, dtype=D, requires_grad=True)
    seen = []

    def f(t):
        # One flag for C++ and Python: the C++ memlean::is_recomputing() (which the C++
        # memlean::BatchNorm2d reads) says the same as memlean.is_recomputing().
        seen.append((memlean.is_recomputing(), memlean._C.is_recomputing()))
        return outer(torch.tanh(memlean.checkpoint(inner, t)))

    outer(torch.tanh(inner(x))).sum().backward()
    tensors = [x] + list(inner.parameters()) + list(outer.parameters())
    plain = grads(tensors)
    memlean.checkpoint(f, x, params=list(outer.parameters()) + list(inner.parameters())).sum().backward()
    assert_same(grads(tensors), plain)
    assert seen == [(False, False), (True, True)]
    assert not memlean.is_recomputing() and not memlean._C.is_recomputing()


@pytest.mark.parametrize("form", ["function", "module"])
# (torch's, from the checkpoint's forward without grad)
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
def test_torchs_reentrant_checkpoint_inside_a_checkpoint(form):
    # transformers' gradient_checkpointing_enable() wraps each layer in torch's reentrant
    # checkpoint (use_reentrant=True) by default, whose backward refuses to run inside a
    # backward given `inputs` (torch.autograd.grad), as the recomputed segment's backward was
    # (memlean.fit, checkpointing BERT's layers in bfloat16, raised "When use_reentrant=True,
    # torch.utils.checkpoint is incompatible with .grad()", 2026-11-30). A recompute that
    # holds such a node runs its backward in full: the gradients of the input and of every
    # parameter, those inside torch's region too, equal the plain function's (float64), and
    # a second step's too (no gradient counted twice).
    torch.manual_seed(3)
    inner = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 5)).to(D)
    outer = nn.Linear(5, 5).to(D)
    x = torch.randn(3, 5, dtype=D, requires_grad=True)

    def f(t):
        h = torch.utils.checkpoint.checkpoint(inner, outer(t), use_reentrant=True)
        return torch.tanh(h) * t

    class F(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.outer = inner, outer

        def forward(self, t):
            return f(t)

    tensors = [x] + list(inner.parameters()) + list(outer.parameters())
    f(x).square().sum().backward()
    plain = grads(tensors)
    for _ in range(2):
        if form == "function":
            y = memlean.checkpoint(f, x, params=list(outer.parameters()) + list(inner.parameters()))
        else:
            y = memlean.checkpoint(F(), x)
        y.square().sum().backward()
        assert_same(grads(tensors), plain)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
def test_a_backward_in_full_frees_the_incoming_gradient_before_it_ends():
    # The backward of a recompute holding torch's reentrant checkpoint runs in full (above).
    # Run as torch.autograd.backward(outputs, gradients), it held the recomputed outputs and
    # their incoming gradients to its end: the least plan memlean.fit made for transformers'
    # GPT-2 with reentrant checkpointing (bfloat16) measured 1 MiB, the checkpointed output
    # and its gradient, above its prediction (2026-11-30). Now, as in the backward that
    # returns the inputs' gradients, the incoming gradient is freed once the nodes that use
    # it have run: by the time torch's region recomputes, it is gone.
    torch.manual_seed(4)
    inner = nn.Linear(5, 5).to(D)
    x = torch.randn(3, 5, dtype=D, requires_grad=True)
    incoming, alive_in_recompute = [], []

    def body(t):
        if torch.is_grad_enabled():  # (torch's reentrant recompute: its forward ran without)
            alive_in_recompute.append(incoming[0]() is not None)
        return inner(t).tanh()

    def f(t):
        return torch.utils.checkpoint.checkpoint(body, t * 2, use_reentrant=True) * t

    y = memlean.checkpoint(f, x, params=list(inner.parameters()))
    y.register_hook(lambda g: incoming.append(weakref.ref(g)))
    y.square().sum().backward()
    assert incoming and alive_in_recompute == [False]
    got = grads([x] + list(inner.parameters()))
    for t in [x] + list(inner.parameters()):
        t.grad = None
    f(x).square().sum().backward()
    assert_same(got, grads([x] + list(inner.parameters())))


def test_recompute_flag_is_cleared_when_the_recompute_fails():
    x = torch.randn(3, dtype=D, requires_grad=True)
    calls = []

    def f(t):
        calls.append(memlean.is_recomputing())
        if len(calls) == 2:
            raise ValueError("fails in the recompute")
        return t * 2

    y = memlean.checkpoint(f, x)
    with pytest.raises(ValueError, match="fails in the recompute"):
        y.sum().backward()
    assert calls == [False, True] and not memlean.is_recomputing()


def test_parameter_listed_twice_gets_its_gradient_once():
    lin = nn.Linear(4, 4).to(D)
    x = torch.randn(2, 4, dtype=D, requires_grad=True)
    lin(x).sum().backward()
    plain = grads([x, lin.weight, lin.bias])
    memlean.CheckpointFunction.apply(lin, 1, x, lin.weight, lin.bias, lin.weight).sum().backward()
    assert_same(grads([x, lin.weight, lin.bias]), plain)


def test_module_parameter_under_two_names_gets_its_gradient_once():
    # One Parameter registered twice in a leaf module (the checkpoint's fast path for leaf
    # modules) and in a module with children (the tree walk).
    for nested in (False, True):
        lin = nn.Linear(4, 4).to(D)
        lin.register_parameter("alias", lin.weight)
        module = nn.Sequential(lin) if nested else lin
        x = torch.randn(2, 4, dtype=D, requires_grad=True)
        module(x).sum().backward()
        plain = grads([x, lin.weight, lin.bias])
        memlean.checkpoint(module, x).sum().backward()
        assert_same(grads([x, lin.weight, lin.bias]), plain)


def test_under_saved_tensors_hooks():
    # Saved parameters come back from the hooks as new tensors sharing the accumulator.
    lin = nn.Linear(4, 4).to(D)
    x = torch.randn(2, 4, dtype=D, requires_grad=True)
    lin(x).sum().backward()
    plain = grads([x, lin.weight, lin.bias])
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        y = memlean.CheckpointFunction.apply(lin, 1, x, lin.weight, lin.bias, lin.weight)
    y.sum().backward()
    assert_same(grads([x, lin.weight, lin.bias]), plain)


def test_dataparallel_replica_parameters_are_collected():
    # Under DataParallel a replica's parameters are non-leaf copies kept as attributes
    # (module.parameters() is empty): pytorch-checkpoint lost them. Build a replica as
    # replicate() does.
    lin = nn.Linear(4, 3).to(D)
    replica = lin._replicate_for_data_parallel()
    replica._former_parameters = {}
    copies = {k: (p * 1) for k, p in lin._parameters.items()}  # non-leaf, like a broadcast
    for k, p in copies.items():
        replica._parameters.pop(k, None)
        setattr(replica, k, p)
        replica._former_parameters[k] = p
    assert list(replica.parameters()) == []
    x = torch.randn(5, 4, dtype=D, requires_grad=True)
    lin(x).pow(2).sum().backward()
    plain = grads([x, lin.weight, lin.bias])
    memlean.checkpoint(replica, x).pow(2).sum().backward()
    assert_same(grads([x, lin.weight, lin.bias]), plain)


def test_backward_twice_with_retain_graph_recomputes():
    lin = nn.Linear(4, 4).to(D)
    x = torch.randn(2, 4, dtype=D, requires_grad=True)
    lin(x).sum().backward()
    once = grads([x, lin.weight])
    y = memlean.checkpoint(lin, x)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    twice = grads([x, lin.weight])
    for a, b in zip(twice, once):
        torch.testing.assert_close(a, 2 * b, rtol=1e-14, atol=0)


def test_backward_on_two_threads_through_one_graph_recomputes_one_at_a_time():
    # The node holds its lock while the Python function recomputes (taking the GIL inside):
    # two threads' backward passes through one retained graph neither overlap nor deadlock.
    import threading
    import time

    lin = nn.Linear(4, 4).to(D)
    x = torch.randn(2, 4, dtype=D, requires_grad=True)
    lin(x).sum().backward()
    once = grads([x, lin.weight])
    state = {"inside": 0, "most": 0, "recomputes": 0}
    lock = threading.Lock()

    def segment(t):
        if memlean.is_recomputing():
            with lock:
                state["inside"] += 1
                state["most"] = max(state["most"], state["inside"])
            time.sleep(0.05)  # releases the GIL: the other thread may run
            with lock:
                state["inside"] -= 1
                state["recomputes"] += 1
        return lin(t)

    loss = memlean.checkpoint(segment, x, params=list(lin.parameters())).sum()
    errors = []

    def run(delay):
        time.sleep(delay)
        try:
            loss.backward(retain_graph=True)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(d,)) for d in (0.0, 0.01)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "backward on two threads deadlocked"
    assert not errors, errors
    assert state == {"inside": 0, "most": 1, "recomputes": 2}
    twice = grads([x, lin.weight])
    for a, b in zip(twice, once):
        torch.testing.assert_close(a, 2 * b, rtol=1e-14, atol=0)


@pytest.mark.parametrize("form", ["function", "module", "keyword", "sequential"])
def test_double_backward_equals_no_checkpoint(form):
    # A gradient penalty: grad with create_graph=True through the checkpoint, then backward
    # through that gradient. Every first and second order gradient (of the input, of a
    # keyword tensor input and of the parameters) equals the call without a checkpoint.
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(4, 5).to(D), nn.Linear(5, 4).to(D)
    params = list(lin1.parameters()) + list(lin2.parameters())
    block = nn.Sequential(lin1, nn.Tanh(), lin2, nn.Softplus())
    x0 = torch.randn(3, 4, dtype=D, requires_grad=True)
    m = torch.randn(3, 4, dtype=D, requires_grad=True)

    def f(t, mask=None):
        y = block(t)
        return y * mask if mask is not None else y

    def step(checkpointed):
        for t in [x0, m, *params]:
            t.grad = None
        x = x0 * 1.5  # not a leaf: the double backward must reach back through it
        if not checkpointed:
            y = f(x, mask=m) if form == "keyword" else block(x)
        elif form == "function":
            y = memlean.checkpoint(f, x, params=params)
        elif form == "module":
            y = memlean.checkpoint(block, x)
        elif form == "keyword":
            y = memlean.checkpoint(f, x, params=params, mask=m)
        else:
            y = memlean.checkpoint_sequential(block, [0, 2], x)
        gx, *gp = torch.autograd.grad(y.pow(2).sum(), [x, *params], create_graph=True)
        penalty = gx.pow(2).sum() + sum(g.pow(2).sum() for g in gp)
        (y.sum() + penalty).backward()
        return [gx.detach(), *[g.detach() for g in gp], x0.grad, m.grad, *[p.grad for p in params]]

    plain, ckpt = step(False), step(True)
    assert all(g is not None for g in ckpt[:-len(params) - 2])
    assert (ckpt[-len(params) - 1] is None) == (form != "keyword")
    for a, b in zip(ckpt, plain):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # torch's own gradgradcheck through the checkpoint, in float64.
    assert torch.autograd.gradgradcheck(
        lambda t: memlean.checkpoint(lambda u: lin2(torch.tanh(lin1(u))) * u, t, params=params),
        (x0,))


# ---- RNG ---------------------------------------------------------------------------------


def dropout_block(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Tanh(), nn.Linear(32, 16), nn.Dropout(0.3)).to(D)


def test_dropout_gradients_equal_with_rng_preservation():
    block = dropout_block()
    x = torch.randn(64, 16, dtype=D, requires_grad=True)
    tensors = [x] + list(block.parameters())
    torch.manual_seed(123)
    block(x).pow(2).sum().backward()
    after_plain = torch.rand(3)
    plain = grads(tensors)
    torch.manual_seed(123)
    memlean.checkpoint(block, x).pow(2).sum().backward()
    # The recompute did not move the RNG stream either.
    assert torch.equal(torch.rand(3), after_plain)
    assert_same(grads(tensors), plain)
    torch.manual_seed(123)
    memlean.CheckpointFunction.apply(block, 1, x, *block.parameters()).pow(2).sum().backward()
    assert_same(grads(tensors), plain)


def test_dropout_differs_without_rng_preservation():
    block = dropout_block()
    x = torch.randn(64, 16, dtype=D, requires_grad=True)
    torch.manual_seed(123)
    block(x).pow(2).sum().backward()
    plain = grads([x])
    torch.manual_seed(123)
    memlean.checkpoint(block, x, preserve_rng_state=False).pow(2).sum().backward()
    assert not torch.equal(grads([x])[0], plain[0])


def test_autocast_state_of_the_forward_is_used_by_the_recompute():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    dtypes = []

    def f(t):
        y = lin(t)
        dtypes.append(y.dtype)
        return y.float()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = memlean.checkpoint(f, x, params=list(lin.parameters()))
    y.sum().backward()  # outside autocast
    assert dtypes == [torch.bfloat16, torch.bfloat16]
    assert not torch.is_autocast_enabled("cpu")


def test_autocast_recompute_casts_a_layer_output_per_use_as_the_forward_did():
    # A segment whose input, a float32 layer output (no leaf; an RMSNorm's, which autocast
    # leaves in float32), feeds two Linears under bf16 autocast (a gated MLP's gate and up
    # projections): the forward casts it once per use and sums the two gradients in float32.
    # Until 2026-11-28 the recompute's detached input was a leaf that requires grad, which
    # autocast caches (as it caches weights): one cast for both uses, their gradients summed in
    # bf16, the input gradient off by bf16's rounding (5e-3 of the largest in a Llama MLP of
    # transformers; here 4.8e-6 absolute). Now bitwise equal to the step without checkpoint;
    # also where the input is a leaf of the user's (cached in both).
    torch.manual_seed(0)
    gate, up, down = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)
    scale = nn.Parameter(torch.rand(32) + 0.5)
    params = [p for m in (gate, up, down) for p in m.parameters()]
    x0 = torch.randn(16, 32)

    def mlp(h):
        return down(F.silu(gate(h)) * up(h))

    def grads(checkpointed, leaf_input):
        for p in params + [scale]:
            p.grad = None
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x if leaf_input else x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * scale
            out = memlean.checkpoint(mlp, h, params=params) if checkpointed else mlp(h)
            loss = (out.float() ** 2).sum()
        loss.backward()  # outside the region, as PyTorch's autocast docs advise
        return [x.grad] + [p.grad for p in params] + ([] if leaf_input else [scale.grad])

    for leaf_input in (False, True):
        for a, b in zip(grads(True, leaf_input), grads(False, leaf_input)):
            assert torch.equal(a, b), leaf_input


def test_autocast_loop_with_backward_outside_the_region_trains_as_without_checkpoint():
    # A loop as PyTorch's autocast docs write it: forward and loss in a region per step,
    # backward and the optimizer step outside it. The recompute's bf16 copies of the weights
    # must not outlive it (autocast would hand the next step's forward those stale copies):
    # every step's loss and the weights after 4 steps equal those of the loop without
    # checkpoint (bitwise: the same bf16 operations on the same values), also with memlean's
    # sequential checkpoint.
    x, y = torch.randn(8, 16), torch.randn(8, 4)

    def train(kind):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 4))
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        losses = []
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if kind == "checkpoint":
                    out = m[4](memlean.checkpoint(m[:4], x))
                elif kind == "checkpoint_sequential":
                    out = memlean.checkpoint_sequential(m, 2, x)
                else:
                    out = m(x)
                loss = ((out.float() - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in m.parameters()]

    plain_losses, plain_params = train("plain")
    for kind in ("checkpoint", "checkpoint_sequential"):
        losses, params = train(kind)
        assert losses == plain_losses, kind
        for a, b in zip(params, plain_params):
            assert torch.equal(a, b), kind


# ---- memory ------------------------------------------------------------------------------


def saved_storages(fn):
    """{storage_key: nbytes} of what autograd saves for backward while fn() runs."""
    with memlean.memstats.saved_storages() as saved:
        out = fn()
    return saved, out


class Chain(nn.Module):
    """n blocks tanh(linear(h)), as a list of layers."""

    def __init__(self, n, width=8):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n))


@pytest.mark.parametrize("per", [1, 2, 3, 4, 6, 12])
def test_a_chain_of_n_blocks_in_k_segments_keeps_only_the_segment_inputs(per):
    chain = Chain(12).to(D)
    x = torch.randn(32, 8, dtype=D, requires_grad=True)
    params = {memlean.memstats.storage_key(p) for p in chain.parameters()}

    def run():
        h, inputs = x, []
        for s in range(0, 12, per):
            inputs.append(memlean.memstats.storage_key(h))
            segment = nn.Sequential(*chain.layers[s:s + per])
            h = memlean.checkpoint(segment, h)
        return h, inputs

    saved, (y, inputs) = saved_storages(run)
    activations = {k: v for k, v in saved.items() if k not in params}
    # Exactly the k segment inputs, each one activation of 32 x 8 float64.
    assert sorted(activations) == sorted(inputs)
    assert sum(activations.values()) == (12 // per) * 32 * 8 * 8
    # The plain chain keeps x and every block's tanh output.
    plain, _ = saved_storages(lambda: nn.Sequential(*chain.layers)(x))
    assert sum(v for k, v in plain.items() if k not in params) == (12 + 1) * 32 * 8 * 8
    y.sum().backward()


@pytest.mark.parametrize("segments", [2, 3, 4, 6])
def test_checkpoint_sequential_keeps_segment_inputs_and_the_last_segment(segments):
    chain = Chain(12).to(D)
    layers = [m for block in chain.layers for m in block]  # 24 layers
    x = torch.randn(32, 8, dtype=D, requires_grad=True)
    params = {memlean.memstats.storage_key(p) for p in chain.parameters()}
    saved, y = saved_storages(lambda: memlean.checkpoint_sequential(layers, segments, x))
    act = 32 * 8 * 8
    # segments - 1 checkpointed segment inputs; the last segment as usual: its input and
    # each block's tanh output (a block's linear saves the tanh output before it).
    last = 12 // segments
    assert sum(v for k, v in saved.items() if k not in params) == (segments - 1) * act + (last + 1) * act
    y.sum().backward()


# ---- checkpoint_sequential and the planner -------------------------------------------------


def test_checkpoint_sequential_gradients_with_dropout_and_batchnorm():
    torch.manual_seed(3)
    layers = []
    for _ in range(4):
        layers += [nn.Conv2d(3, 3, 3, padding=1), memlean.BatchNorm2d(3), nn.ReLU(), nn.Dropout(0.2)]
    plain = nn.Sequential(*layers).to(D)
    ckpt = copy.deepcopy(plain)
    x = torch.randn(4, 3, 6, 6, dtype=D, requires_grad=True)
    torch.manual_seed(9)
    plain(x).pow(2).sum().backward()
    g_plain = grads([x] + list(plain.parameters()))
    for segments in [1, 2, 3, "sqrt", [0, 5, 11], memlean.SegmentPlan([0, 8], 0)]:
        model = copy.deepcopy(ckpt)
        torch.manual_seed(9)
        memlean.checkpoint_sequential(model, segments, x).pow(2).sum().backward()
        g = grads([x] + list(model.parameters()))
        for a, b in zip(g, g_plain):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert_same(list(model.buffers()), list(plain.buffers()))


def test_torch_batchnorm_in_checkpoint_sequential_is_updated_once():
    torch.manual_seed(4)
    plain = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)).to(D)
    ckpt = copy.deepcopy(plain)
    x = torch.randn(4, 3, 5, 5, dtype=D)
    plain(x).sum().backward()
    memlean.checkpoint_sequential(ckpt, 2, x).sum().backward()
    assert_same(list(ckpt.buffers()), list(plain.buffers()))


class _Doubling(nn.Module):
    """y = x * scale after scale *= 2: a forward that updates a buffer and reads it (as spectral
    norm's power iteration and a QAT observer do); through_data: the update through
    ``scale.data``, which leaves the buffer's version counter alone (as older code does)."""

    def __init__(self, through_data=False):
        super().__init__()
        self.register_buffer("scale", torch.full((1,), 1.5, dtype=torch.float64))
        self.through_data = through_data

    def forward(self, x):
        if self.through_data:
            self.scale.data.mul_(2)
        else:
            with torch.no_grad():
                self.scale.mul_(2)
        return x * self.scale


@pytest.mark.parametrize("through_data", [False, True], ids=["in_the_open", "through_data"])
@pytest.mark.parametrize("form", ["module", "function", "sequential", "fit"])
def test_the_recompute_begins_from_the_buffers_the_forward_began_from(form, through_data):
    # A segment whose forward updates a buffer it reads is recomputed from the buffer's value
    # at the forward's start: gradients equal the plain ones in float64 (recomputed from the
    # updated values they did not: 8e-6 off with torch's spectral norm, which torch's own
    # non-reentrant checkpoint still is), and the buffers are updated once. Forms: a module,
    # a function calling it, checkpoint_sequential, and a module memlean.fit checkpoints.
    # through_data: the update made through .data, which no version counter sees (found by
    # value since 2026-11-27; before, the recompute began from the updated scale: twice the
    # gradient through it).
    def model():
        torch.manual_seed(0)
        return nn.Sequential(torch.nn.utils.spectral_norm(nn.Linear(8, 16)), nn.Tanh(),
                             _Doubling(through_data), nn.Linear(16, 8), nn.Tanh(),
                             torch.nn.utils.spectral_norm(nn.Linear(8, 8))).double()

    torch.manual_seed(1)
    x = torch.randn(32, 8, dtype=torch.float64)
    plain, ckpt = model(), model()
    plain(x).square().sum().backward()
    if form == "module":
        y = memlean.checkpoint(ckpt, x)
    elif form == "function":
        y = memlean.checkpoint(lambda h: ckpt[3:](ckpt[:3](h)), x, params=list(ckpt.parameters()))
    elif form == "sequential":
        y = memlean.checkpoint_sequential(ckpt, [0, 3], x)
    else:
        from memlean import fitting

        head, tail = ckpt[:3], ckpt[3:]
        undo = fitting._wrap(head)  # (as fit checkpoints a module: its own forward)
        y = tail(head(x))
    y.square().sum().backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-14, msg=name)
    assert_same(list(ckpt.buffers()), list(plain.buffers()))
    if form == "fit":
        undo()


def test_a_buffer_the_forward_leaves_alone_keeps_no_copy():
    # The buffers to rewind are copied before the forward and the copies of those it did not
    # change dropped after it: a segment reading a 4 MiB constant buffer keeps its input and
    # output only (exact bytes), and one whose forward updates that buffer keeps one copy more
    # until its backward, whether the update moves its version counter or goes through .data
    # (seen by value). A buffer made in inference_mode (no version counter; it cannot
    # change outside it) is left alone, in the module and the function form.
    table = torch.ones(2 ** 20)

    class Reads(nn.Module):
        def __init__(self, update):
            super().__init__()
            self.register_buffer("table", table)
            self.update = update

        def forward(self, x):
            if self.update == ".data":
                self.table.data.add_(1)
            elif self.update:
                with torch.no_grad():
                    self.table.add_(1)
            return torch.tanh(x) * self.table[:4]

    with torch.inference_mode():  # (no version counter; cannot change outside it)
        constant = torch.ones(4)
    probe = Reads(False)
    probe.register_buffer("constant", constant)
    probe.forward = lambda x: torch.tanh(x) * probe.table[:4] + probe.constant
    x = torch.randn(4, requires_grad=True)
    memlean.checkpoint(probe, x).sum().backward()
    memlean.checkpoint(lambda h: probe(h), x, params=[]).sum().backward()
    for update, extra in ((False, 0), (True, table.nbytes), (".data", table.nbytes)):
        layer = Reads(update)
        x = torch.randn(4, requires_grad=True)
        with memlean.memstats.track("cpu") as t:
            start = t.current
            y = memlean.checkpoint(layer, x)
            kept = t.current - start
            y.sum().backward()
            del y
        assert kept == 4 * 4 + extra, (update, kept)


class _Counts(nn.Module):
    """x -> tanh(x) + buf[0], adding 1 to every element of its buffer in each forward (a
    running statistic); `registered`: whether buf is its buffer or only read through it."""

    def __init__(self, buf, registered):
        super().__init__()
        if registered:
            self.register_buffer("buf", buf)
        else:
            self.__dict__["buf"] = buf

    def forward(self, x):
        with torch.no_grad():
            self.buf.add_(1)
        return torch.tanh(x) + self.buf[0]


@pytest.mark.parametrize("holders", ["both", "first"])
def test_checkpoint_sequential_restores_a_shared_buffer_once(holders):
    # Two layers of one checkpointed segment hold the same buffer of 2**20 floats, which
    # their forward updates and reads. It is copied once before the forward (the recompute
    # begins from it) and once before the recompute (put back after it): the step's peak is
    # that of a chain where only the first layer holds it (a second pair of copies would add
    # 8 MiB), it is 8 MiB above a chain where no layer holds it (the two copies), and the
    # buffer has each forward's update (2), not the recompute's.
    def peak(registered):
        with memlean.memstats.track("cpu") as t:  # everything made and freed inside
            start = t.current  # (what earlier tests left alive)
            buf = torch.zeros(2 ** 20)
            layers = [_Counts(buf, registered[0]), _Counts(buf, registered[1]), nn.Tanh()]
            x = torch.randn(4, requires_grad=True)
            memlean.checkpoint_sequential(layers, [0, 2], x).sum().backward()
            del layers, x
        assert t.current - start == buf.nbytes
        assert torch.equal(buf, torch.full_like(buf, 2.0 if any(registered) else 4.0))
        return t.peak

    shared = peak((True, True) if holders == "both" else (True, False))
    assert shared == peak((True, False))
    assert shared == peak((False, False)) + 8 * 2 ** 20


class _ScaledMasked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale=1.0, mask=None):
        y = torch.tanh(self.lin(x)) * scale
        return y * mask if mask is not None else y


@pytest.mark.parametrize("form", ["module", "function"])
def test_keyword_arguments_are_inputs_like_positional_ones(form):
    # A layer called as layer(x, scale=2.0, mask=m): values and gradients (of x, of the
    # keyword tensor m and of the parameters) equal the call without a checkpoint.
    torch.manual_seed(0)
    layer = _ScaledMasked().double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    m = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    def run(checkpointed):
        layer.zero_grad(set_to_none=True)
        x.grad = m.grad = None
        if not checkpointed:
            out = layer(x, scale=2.0, mask=m)
        elif form == "module":
            out = memlean.checkpoint(layer, x, scale=2.0, mask=m)
        else:
            out = memlean.checkpoint(lambda a, scale, mask: layer(a, scale=scale, mask=mask), x,
                                     params=list(layer.parameters()), scale=2.0, mask=m)
        out.pow(2).sum().backward()
        return out.detach(), x.grad, m.grad, layer.lin.weight.grad

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_tensors_inside_lists_and_dicts_are_inputs_too():
    # layer([a, b], {"scale": s}): the tensors in the containers are saved, recomputed and
    # differentiated (gradients equal the plain call), and the function's activations are
    # not kept: only the input tensors are saved.
    torch.manual_seed(0)
    a, b, s = (torch.randn(4, 8, dtype=D, requires_grad=True) for _ in range(3))

    def f(pair, extra):
        return torch.tanh(pair[0] * pair[1]).exp() * extra["scale"]

    f([a, b], {"scale": s}).pow(2).sum().backward()
    plain = grads([a, b, s])
    with memlean.memstats.saved_storages() as saved:
        y = memlean.checkpoint(f, [a, b], {"scale": s})
    assert set(saved) == {memlean.memstats.storage_key(t) for t in (a, b, s)}
    y.pow(2).sum().backward()
    for got, want in zip(grads([a, b, s]), plain):
        torch.testing.assert_close(got, want, rtol=1e-14, atol=0)


def test_planner():
    costs = [memlean.LayerCost(100, 100)] * 16
    plan = memlean.plan_segments(costs)
    assert plan.starts == [0, 4, 8, 12] and plan.fits_budget and plan.num_segments == 4
    assert plan.estimated_peak_bytes == 300 + 100 + 400
    assert memlean.plan_segments(costs, budget_bytes=10**9).starts == [0]
    tight = memlean.plan_segments(costs, budget_bytes=500)
    assert not tight.fits_budget and tight.estimated_peak_bytes > 500
    mid = memlean.plan_segments(costs, budget_bytes=1200)
    assert mid.fits_budget and mid.estimated_peak_bytes <= 1200
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        memlean.plan_segments(costs, -1)
    with pytest.raises(TypeError, match=r"costs\[0\] is a tuple, not a LayerCost"):
        memlean.plan_segments([(1, 2)])


def test_measure_layer_costs_is_exact_and_has_no_side_effects():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 4),
                          nn.ReLU(inplace=True)).to(D)
    bn = nn.Sequential(nn.Conv2d(3, 3, 1), memlean.BatchNorm2d(3))
    x = torch.randn(10, 8, dtype=D)
    state = torch.get_rng_state()
    costs = memlean.measure_layer_costs(model, x)
    assert torch.equal(torch.get_rng_state(), state)
    h = 10 * 16 * 8
    assert [c.input_bytes for c in costs] == [10 * 8 * 8, h, h, h, 10 * 4 * 8]
    # Linear: its output; Tanh: its output (saved); Dropout: output and mask; in-place ReLU: nothing new.
    assert [c.activation_bytes for c in costs] == [h, h, 2 * h, 10 * 4 * 8, 0]
    memlean.measure_layer_costs(bn, torch.randn(4, 3, 5, 5))
    assert bn[1].num_batches_tracked.item() == 0
    plan = memlean.plan_segments(costs)
    assert plan.starts == [0, 2]


class _KeepsACopy(nn.Module):
    """A layer that keeps a copy of its output outside autograd (a cache)."""

    def forward(self, h):
        self.cache = h.detach().clone()
        return torch.tanh(h)


def test_measure_layer_costs_counts_what_a_layer_keeps_outside_autograd():
    # One measurement for C++ and Python: every allocation of the layer still alive counts
    # (the cache, the saved output), not only what autograd saves.
    layer = _KeepsACopy()
    x = torch.randn(10, 8, dtype=D)
    (cost,) = memlean.measure_layer_costs([layer], x)
    assert cost.input_bytes == 10 * 8 * 8
    assert cost.activation_bytes == 2 * 10 * 8 * 8  # the tanh output (saved) + the cache
    # A temporary the layer frees is not counted.
    (cost,) = memlean.measure_layer_costs([lambda h: torch.tanh(h * 2)], x)
    assert cost.activation_bytes == 10 * 8 * 8


def test_measure_layer_costs_names_a_layer_that_returns_no_tensor():
    with pytest.raises(TypeError, match=r"memlean.measure_layer_costs: layer 1 returned a tuple"):
        memlean.measure_layer_costs([nn.Identity(), lambda h: (h, h)], torch.randn(2))
    with pytest.raises(TypeError, match=r"memlean.measure_layer_costs: input must be a tensor"):
        memlean.measure_layer_costs([nn.Identity()], [1.0])


# ---- BatchNorm2d -------------------------------------------------------------------------


def test_batchnorm_is_a_drop_in():
    ours, theirs = memlean.BatchNorm2d(5, momentum=0.2), nn.BatchNorm2d(5, momentum=0.2)
    assert isinstance(ours, nn.BatchNorm2d)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert repr(ours) == repr(theirs)
    with pytest.raises(ValueError, match="expected 4D input"):
        ours(torch.randn(2, 5))


@pytest.mark.parametrize("kw", [{}, {"momentum": None}, {"affine": False}, {"track_running_stats": False}])
def test_batchnorm_behaves_as_torchs_outside_checkpoints(kw):
    torch.manual_seed(6)
    ours, theirs = memlean.BatchNorm2d(4, **kw).to(D), nn.BatchNorm2d(4, **kw).to(D)
    for _ in range(3):
        x = torch.randn(6, 4, 3, 3, dtype=D)
        assert torch.equal(ours(x), theirs(x))
    with torch.no_grad():  # a train-mode forward under no_grad updates, as torch's does
        x = torch.randn(6, 4, 3, 3, dtype=D)
        assert torch.equal(ours(x), theirs(x))
    assert_same(list(ours.buffers()), list(theirs.buffers()))
    ours.eval(), theirs.eval()
    x = torch.randn(2, 4, 3, 3, dtype=D)
    assert torch.equal(ours(x), theirs(x))
    assert_same(list(ours.buffers()), list(theirs.buffers()))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_statistics_after_a_checkpointed_step_equal_the_plain_step(momentum):
    plain, ckpt = make(), make()
    plain.norm.momentum = ckpt.norm.momentum = momentum
    x = torch.randn(8, 4, 5, 5, dtype=D)
    plain(x).pow(2).sum().backward()
    # pytorch-checkpoint's DenseNet example: bn_function, its parameters listed.
    def bn_function(t):
        return ckpt.conv(F.relu(ckpt.norm(t)))

    args = (x,) + tuple(ckpt.norm.parameters()) + tuple(ckpt.conv.parameters())
    memlean.CheckpointFunction.apply(bn_function, 1, *args).pow(2).sum().backward()
    assert ckpt.norm.num_batches_tracked.item() == 1
    assert_same(list(ckpt.buffers()), list(plain.buffers()))
    assert_same([p.grad for p in ckpt.parameters()], [p.grad for p in plain.parameters()])


def test_torchs_batchnorm_in_a_function_checkpoint_counts_once():
    # pytorch-checkpoint's note: torch's BatchNorm was updated by the recompute too (2 here);
    # memlean's recompute now keeps every BatchNorm's statistics (more in batchnorm_test.py).
    bn = nn.BatchNorm2d(4).to(D)
    x = torch.randn(8, 4, 5, 5, dtype=D, requires_grad=True)
    memlean.CheckpointFunction.apply(bn, 1, x, *bn.parameters()).sum().backward()
    assert bn.num_batches_tracked.item() == 1


def test_batchnorm_eval_mode_inside_a_checkpoint_is_unaffected():
    block = make()
    block(torch.randn(8, 4, 5, 5, dtype=D))
    block.eval()
    before = copy.deepcopy(block.state_dict())
    x = torch.randn(8, 4, 5, 5, dtype=D, requires_grad=True)
    y = memlean.checkpoint(block, x)
    y.sum().backward()
    assert torch.equal(y, block(x))
    assert_same(list(block.state_dict().values()), list(before.values()))


def test_batchnorm_convert():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, momentum=0.3), nn.Sequential(nn.BatchNorm2d(4)))
    model(torch.randn(4, 3, 2, 2))
    state = copy.deepcopy(model.state_dict())
    model = memlean.BatchNorm2d.convert(model)
    assert type(model[1]) is memlean.BatchNorm2d and type(model[2][0]) is memlean.BatchNorm2d
    assert model[1].momentum == 0.3
    assert_same(list(model.state_dict().values()), list(state.values()))


# ---- bad input ---------------------------------------------------------------------------


def test_n_larger_than_the_arguments():
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"memlean.CheckpointFunction: n is 3 but only 2 arguments were given"):
        memlean.CheckpointFunction.apply(lambda a, b, c: a, 3, x, x)
    with pytest.raises(ValueError, match="must be >= 0, got -1"):
        memlean.CheckpointFunction.apply(lambda: x, -1, x)
    with pytest.raises(TypeError, match="n \\(the number of inputs\\) must be an int, got a float"):
        memlean.CheckpointFunction.apply(lambda a: a, 1.0, x)


def test_a_parameter_that_is_not_a_tensor():
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(TypeError, match=r"parameter 1 \(argument 2\) is a float, not a tensor"):
        memlean.CheckpointFunction.apply(lambda a: a * 2, 1, x, x, 0.5)
    with pytest.raises(TypeError, match=r"parameter 0 \(argument 1\) is None, not a tensor"):
        memlean.checkpoint(lambda a: a * 2, x, params=[None])
    with pytest.raises(TypeError, match="function must be callable, got a Tensor"):
        memlean.checkpoint(x, x)


def test_a_function_that_returns_no_tensor_returns_its_value():
    # As torch.utils.checkpoint: nothing to differentiate, so the value is returned as it is
    # (and the function's side effects happen once).
    x = torch.randn(2, requires_grad=True)
    calls = []

    def f(a):
        calls.append(1)
        return None

    assert memlean.checkpoint(f, x) is None and calls == [1]
    assert memlean.CheckpointFunction.apply(lambda a: (1, "a"), 1, x) == (1, "a")
    assert memlean.checkpoint(lambda a: {"n": a.numel()}, x) == {"n": 2}
    with torch.no_grad():  # also on the plain-call path
        assert memlean.checkpoint(lambda a: [], x) == []
    # An integer tensor among the outputs: returned, with nothing to differentiate.
    idx = memlean.checkpoint(lambda a: a.argmax(), x)
    assert idx.dtype == torch.int64 and not idx.requires_grad and idx.item() == x.argmax().item()
    # Beside a float tensor, the rest of the structure still comes back.
    y, n = memlean.checkpoint(lambda a: (a.sin(), 3), x)
    assert n == 3 and y.requires_grad
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().cos())


def test_backward_through_a_checkpoint_twice():
    lin = nn.Linear(3, 3)
    y = memlean.checkpoint(lin, torch.randn(2, 3, requires_grad=True))
    y.sum().backward()
    with pytest.raises(RuntimeError, match="memlean.checkpoint: backward ran through this checkpoint a second time"):
        y.sum().backward()


def test_a_parameter_that_was_not_listed():
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    y = memlean.CheckpointFunction.apply(lin, 1, x, lin.weight)  # bias forgotten
    with pytest.raises(RuntimeError, match=r"neither one of its inputs nor one of the parameters given "
                                           r"to the checkpoint \(it reaches a leaf of shape \[3\] through"):
        y.sum().backward()
    outside = torch.randn(2, 3, requires_grad=True) * 2
    y = memlean.checkpoint(lambda t: lin(t) + outside, x, params=list(lin.parameters()))
    with pytest.raises(RuntimeError, match="its gradient would be lost"):
        y.sum().backward()
    # A double backward's walk (which keeps the inputs undetached) finds it too.
    y = memlean.CheckpointFunction.apply(lin, 1, x, lin.weight)
    with pytest.raises(RuntimeError, match=r"it reaches a leaf of shape \[3\] through"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_a_function_that_modifies_its_input_in_place():
    x = torch.randn(2, 3, requires_grad=True) * 1
    with pytest.raises(RuntimeError, match="the function modified its input 0 in place"):
        memlean.checkpoint(lambda t: t.relu_(), x)


def test_an_input_modified_before_backward():
    lin = nn.Linear(3, 3)
    h = torch.randn(2, 3, requires_grad=True) * 1
    y = memlean.checkpoint(lin, h)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_bad_segments():
    layers = [nn.Linear(2, 2), nn.Tanh()]
    x = torch.randn(1, 2)
    with pytest.raises(ValueError, match=r"segments must be between 1 and the number of layers \(2\), got 3"):
        memlean.checkpoint_sequential(layers, 3, x)
    with pytest.raises(ValueError, match="the first segment must start at layer 0"):
        memlean.checkpoint_sequential(layers, [1], x)
    with pytest.raises(ValueError, match="segment starts must increase"):
        memlean.checkpoint_sequential(layers, [0, 0], x)
    with pytest.raises(ValueError, match="'sqrt'"):
        memlean.checkpoint_sequential(layers, "half", x)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_under_torch_compile_the_checkpoint_runs_eagerly_and_keeps_its_saving(backend):
    # Dynamo does not trace into the checkpoint: it runs as in eager mode (saving only its
    # input and the parameters), the code around it is compiled, and gradients are eager's.
    torch.manual_seed(5)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).to(D)
    x = torch.randn(4, 8, dtype=D, requires_grad=True)
    tensors = [x] + list(block.parameters())

    def f(t):
        return torch.sin(memlean.checkpoint(block, t * 2)).sum()

    def saved_shapes(fn):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t,
                                                      lambda t: t):
            y = fn(x)
        return y, shapes

    y, eager_saved = saved_shapes(f)
    y.backward()
    want = grads(tensors)
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return torch._dynamo.backends.registry.lookup_backend(backend)(gm, example_inputs)

    y, compiled_saved = saved_shapes(torch.compile(f, backend=capture))
    y.backward()
    for got, w in zip(grads(tensors), want):  # inductor's fused sin/mul: float64 rounding
        torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)
    # What the checkpoint saves is its input and the parameters, compiled or not.
    assert sorted(s for s in compiled_saved if s in [(8, 8), (8,)]) == [(8,), (8,), (8, 8), (8, 8)]
    assert (4, 8) in compiled_saved and sorted(eager_saved) == sorted(compiled_saved)
    # The segment's own ops are not in the compiled graphs: it ran eagerly.
    assert graphs and not any("linear" in t or "tanh" in t for g in graphs for t in g), graphs


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))


# ---- one implementation: the C++ checkpoint's node, run with a Python function -------------


def test_the_python_checkpoint_is_the_cpp_node():
    lin = nn.Linear(4, 4).to(D)
    x = torch.randn(2, 4, dtype=D, requires_grad=True)
    assert memlean.checkpoint(lin, x).grad_fn.name() == "memlean::CheckpointBackward"
    y = memlean.CheckpointFunction.apply(lin, 1, x, *lin.parameters())
    assert y.grad_fn.name() == "memlean::CheckpointBackward"


def test_an_input_returned_as_it_is_keeps_its_own_history():
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    h = x * 2  # a non-leaf input: its grad_fn must stay MulBackward0
    y = memlean.checkpoint(lambda t: t, h)
    assert y is not h and y.data_ptr() == h.data_ptr()
    assert h.grad_fn.name() == "MulBackward0" and y.grad_fn.name() == "memlean::CheckpointBackward"
    (y * 3).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 6.0))


def test_a_python_error_in_the_recompute_keeps_its_type():
    calls = []

    def f(t):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("raised by the function in its recompute")
        return t.sin()

    x = torch.randn(3, dtype=D, requires_grad=True)
    y = memlean.checkpoint(f, x)
    with pytest.raises(ValueError, match="raised by the function in its recompute"):
        y.sum().backward()


def test_the_function_is_released_by_backward_and_with_the_graph():
    import gc
    import weakref

    class Fn:
        def __call__(self, t):
            return t.exp()

    x = torch.randn(3, dtype=D, requires_grad=True)
    for run_backward in (True, False):
        fn = Fn()
        alive = weakref.ref(fn)
        y = memlean.checkpoint(fn, x)
        del fn
        gc.collect()
        assert alive() is not None  # the node holds it for the recompute
        if run_backward:
            y.sum().backward()  # frees what the node kept
            assert alive() is None
        del y
        gc.collect()
        assert alive() is None


def test_a_module_segment_keeps_the_batchnorm_statistics_of_its_tree_without_a_global_hook():
    block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(D)
    hooks_seen = []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: hooks_seen.append(type(m).__name__))
    try:
        x = torch.randn(8, 4, dtype=D, requires_grad=True)
        y = memlean.checkpoint(block, x)
        after_forward = [b.clone() for b in block[1].buffers()]
        y.sum().backward()
    finally:
        handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(after_forward, block[1].buffers()))
    assert int(block[1].num_batches_tracked) == 1
    # The forward and the recompute each called the 3 modules, and nothing else hooked them.
    assert hooks_seen == ["Sequential", "Linear", "BatchNorm1d"] * 2


@pytest.mark.parametrize("how", ["function", "module"])
def test_backward_frees_the_recomputed_output_and_its_gradient_early(how):
    # cos(sin(x)): cos keeps sin(x), and no node keeps the output. The checkpoint's backward
    # frees the recomputed output at once and the incoming gradient once cos's backward has
    # used it, so a step's peak is the plain step's to the byte, and no higher than with
    # torch's non-reentrant checkpoint (holding both through the segment's backward, as a
    # reentrant checkpoint does, adds two activations).
    n = 2 ** 16
    x = torch.randn(n, dtype=D, requires_grad=True)
    c = torch.randn(n, dtype=D)  # makes the incoming gradient a real tensor

    class CosSin(nn.Module):
        def forward(self, t):
            return torch.cos(torch.sin(t))

    f = CosSin() if how == "module" else (lambda t: torch.cos(torch.sin(t)))
    runs = {
        "plain": f,
        "memlean": lambda t: memlean.checkpoint(f, t),
        "torch": lambda t: torch.utils.checkpoint.checkpoint(f, t, use_reentrant=False),
    }
    peak, grad = {}, {}
    for name, run in runs.items():
        with memlean.memstats.track("cpu") as t:
            before = t.current  # (the gradients of the runs before are alive)
            loss = (run(x) * c).sum()
            t.reset_peak()
            loss.backward()
            del loss
        peak[name] = t.peak - before
        grad[name] = grads([x])
    assert_same(grad["memlean"], grad["plain"])
    assert peak["plain"] >= 3 * x.nbytes  # the incoming gradient, sin(x) and a gradient
    assert peak["memlean"] == peak["plain"], peak
    assert peak["memlean"] <= peak["torch"], peak
