"""memlean.fit on torchvision's architectures, as users train them: the code paths fit_test's
own nets do not take. Residual adds written in place onto an activation's output
(EfficientNetV2's FusedMBConv: `result += input` after SiLU(inplace=True)), ReLU6(inplace=True)
(MobileNetV2), channel shuffle through views and torch.chunk (ShuffleNetV2), a dense block's
list of feature maps concatenated by every layer (DenseNet), parallel inception branches
(GoogLeNet). For each, float64 on the CPU: at the least peak fit names and at a budget between
it and the eager peak, the step measured here (not with fit's code) peaks at or under the
budget and equals fit's figure, and three training steps through the plan equal the unfitted
twin's (gradients, parameters, BatchNorm statistics).

Running fit on 18 torchvision models (2026-11-27) found that fit made EfficientNetV2's
SiLU(inplace=True) in place although the residual then wrote its output: the user's first
step failed with autograd's "modified by an inplace operation" (docs/fit.md, step 2).

`python fit_zoo_test.py --models resnet18,vit_b_16 --size 224` runs the same checks on any
torchvision classification models (a probe, not a test).

FitTransformersTest does the same for transformers' GPT-2 and Llama (small configurations, no
weights loaded from a hub), with use_cache as their configurations default it in training
(True: every layer is handed a DynamicCache, which its attention updates) and False (what
gradient_checkpointing_enable() sets). Running fit on transformers' GPT-2 (2026-11-28) found
that fit checkpointed the attention modules handed the cache: the recompute appended the keys
again, attended over twice the keys, and the gradients were 100 % off, silently.
"""
import argparse
import contextlib
import copy
import sys
import unittest
import warnings

import torch

import memlean
import optional_deps
from fit_test import cross_entropy_of, plain_checkpoints, step_peak, train_side_by_side


def make(name):
    """A torchvision model, small where the architecture allows, float64, training mode."""
    if not optional_deps.available("torchvision"):
        raise unittest.SkipTest("torchvision: this environment is made without it "
                                "(MEMLEAN_WITHOUT; it runs as a unittest script)")
    import torchvision

    models = torchvision.models
    if name == "densenet_small":  # DenseNet-BC's layers at a test's size
        return models.DenseNet(growth_rate=12, block_config=(3, 3, 3), num_init_features=24,
                               bn_size=4, num_classes=10).double()
    kwargs = {"num_classes": 10}
    if name in ("googlenet", "inception_v3"):
        kwargs.update(aux_logits=False, init_weights=False)
    return getattr(models, name)(**kwargs).double()


class FitZooTest(unittest.TestCase):
    SIZE = 64
    BATCH = 2

    def check(self, name, size=None, batch=None):
        size, batch = size or self.SIZE, batch or self.BATCH
        torch.manual_seed(0)
        model = make(name).train()
        twin = copy.deepcopy(model)
        x = torch.randn(batch, 3, size, size, dtype=torch.double)
        loss_fn = cross_entropy_of(torch.randint(0, 10, (batch,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        opt_twin = torch.optim.SGD(twin.parameters(), lr=0.01, momentum=0.9)
        with self.assertRaises(memlean.FitError) as caught:
            memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt)
        least = caught.exception.least_peak_bytes
        eager = memlean.fit(model, x, 2**50, loss_fn=loss_fn, optimizer=opt).eager_peak_bytes
        self.assertLess(least, eager, name)
        rows = []
        for budget in (least, (least + eager) // 2):
            plan = memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt)
            if not opt.state:
                step_peak(model, (x,), loss_fn, opt)  # the optimizer's state, as fit had it
            measured = step_peak(model, (x,), loss_fn, opt)
            self.assertLessEqual(measured, budget, f"{name}, budget {budget}: {plan}")
            self.assertEqual(measured, plan.peak_bytes, f"{name}: {plan}")
            rows.append((budget, plan.peak_bytes, plan.predicted_peak_bytes, len(plan.actions)))
            plan.undo()
        # Training through the plan at the least peak equals the twin's: three steps, each
        # forward from the same RNG state, the last without its optimizer step. Each tensor
        # within a fraction of its own largest element: memlean's in-place Swish within its
        # float64 bound (docs/swish.md), everything else to float64 rounding, which these
        # small nets' BatchNorms (few elements per channel) amplify about 100-fold per step.
        torch.manual_seed(0)
        model = make(name).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
        swish = any(a.action == "inplace swish" for a in plan.actions)
        train_side_by_side(model, opt, twin, opt_twin, x, loss_fn)
        # (A gradient that is zero but for rounding, e.g. of a BatchNorm's bias where another
        # BatchNorm follows, is held to a thousandth of the largest gradient instead.)
        tolerance = 1e-6 if swish else 1e-8
        named = list(zip(model.named_parameters(), twin.parameters()))
        kinds = {"gradient": [(n, p.grad, q.grad) for (n, p), q in named],
                 "parameter": [(n, p, q) for (n, p), q in named],
                 "buffer": [(n, b, c) for (n, b), c in zip(model.named_buffers(), twin.buffers())
                            if b.numel()]}
        for kind, pairs in kinds.items():
            largest = max((b.double().abs().max().item() for _, _, b in pairs),
                          default=0.0)  # (a model without buffers: none)
            for what, a, b in pairs:
                scale = max(b.double().abs().max().item(), largest / 1000)
                self.assertLessEqual((a.double() - b.double()).abs().max().item(),
                                     tolerance * scale, f"{name}: {kind} {what}")
        plan.undo()
        return least, eager, rows

    def test_efficientnet_v2_s(self):
        # (its early FusedMBConv blocks add the residual in place onto SiLU(inplace=True)'s
        # output: those SiLUs stay, the others become in-place Swishes)
        torch.manual_seed(0)
        self.check("efficientnet_v2_s", size=32)
        model = make("efficientnet_v2_s").train()
        x = torch.randn(2, 3, 32, 32, dtype=torch.double)
        eager = memlean.fit(model, x, 2**50).eager_peak_bytes
        plan = memlean.fit(model, x, eager - 1)
        in_place = {a.path for a in plan.actions if a.action == "inplace swish"}
        self.assertFalse("features.1.0.block.0.2" in in_place,
                         "features.1.0's SiLU, whose output the residual writes, made in place")
        self.assertTrue("features.1.1.block.0.2" in in_place, "features.1.1's SiLU not in place")
        plan.undo()

    def test_mobilenet_v2(self):
        self.check("mobilenet_v2")

    def test_shufflenet_v2(self):
        self.check("shufflenet_v2_x0_5")

    def test_densenet(self):
        self.check("densenet_small")

    def test_googlenet(self):
        self.check("googlenet")


class FitTransformersTest(unittest.TestCase):
    """transformers' decoders, float64 on the CPU, a batch of 4 sequences of 64 tokens."""

    def make(self, kind, use_cache):
        transformers = optional_deps.require("transformers")
        torch.manual_seed(0)
        # MLPs of 1024 hidden features: 2 MiB hidden tensors, which fit slices in two.
        if kind == "gpt2":  # (dropout 0.1 everywhere, as GPT2Config has it)
            config = transformers.GPT2Config(n_layer=2, n_embd=64, n_inner=1024, n_head=4,
                                             n_positions=64, vocab_size=256,
                                             use_cache=use_cache)
            model = transformers.GPT2LMHeadModel(config)
        else:
            config = transformers.LlamaConfig(
                hidden_size=64, intermediate_size=1024, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                max_position_embeddings=64, use_cache=use_cache)
            model = transformers.LlamaForCausalLM(config)
        return model.double().train()

    def assert_kept(self, plan, model, x, loss_fn, opt, budget):
        """The plan's step, measured here: within budget, the peak fit measured, predicted
        within max(2 %, 1 MiB)."""
        if not opt.state:
            step_peak(model, (x,), loss_fn, opt)  # the state fit measured with
        measured = step_peak(model, (x,), loss_fn, opt)
        self.assertLessEqual(measured, budget, str(plan))
        self.assertEqual(measured, plan.peak_bytes, str(plan))
        self.assertLessEqual(abs(plan.predicted_peak_bytes - measured),
                             max(measured // 50, 1 << 20), str(plan))

    def check(self, kind, layers, attention, least_actions):
        """fit at its least and a budget between it and the eager peak, with and without the
        cache: kept (measured here), predicted within max(2 %, 1 MiB); with the cache no
        module handed it checkpointed (`layers`.N and `layers`.N.`attention`) and a warning
        naming DynamicCache; without it, those modules checkpointed at the least, which is
        lower; at the least each block's (path, action) of `least_actions` (transformers'
        own MLP modules, activations and GPT-2's Conv1D, sliced and swapped as torch's);
        three training steps at the least equal the unfitted twin's (dropout masks
        included)."""
        idx = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
        x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

        def loss_fn(out):
            return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())

        handed = {f"{layers}.{i}" for i in range(2)} | {f"{layers}.{i}.{attention}"
                                                         for i in range(2)}
        leasts = {}
        for use_cache in (True, False):
            model = self.make(kind, use_cache)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with self.assertRaises(memlean.FitError) as error:
                    memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt)
                least = leasts[use_cache] = error.exception.least_peak_bytes
                eager = memlean.fit(model, x, 2**50, loss_fn=loss_fn,
                                    optimizer=opt).eager_peak_bytes
                self.assertLess(least, eager)
                for budget in ((least + eager) // 2, least):
                    plan = memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt)
                    self.assert_kept(plan, model, x, loss_fn, opt, budget)
                    checkpointed = {a.path for a in plan.actions if a.action == "checkpoint"}
                    self.assertTrue(checkpointed, str(plan))
                    if use_cache:
                        self.assertFalse(handed & checkpointed, str(plan))
                    plan.undo()
            said = [str(w.message) for w in caught if "DynamicCache" in str(w.message)]
            self.assertEqual(bool(said), use_cache, said)
            if not use_cache:
                self.assertTrue(handed & checkpointed, str(plan))
                done = {(a.path, a.action) for a in plan.actions}
                for i in range(2):
                    for path, action in least_actions:
                        self.assertIn((f"{layers}.{i}.{path}", action), done, str(plan))
            # Training at the least, a fresh model beside its twin.
            model = self.make(kind, use_cache)
            twin = copy.deepcopy(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            opt_twin = torch.optim.SGD(twin.parameters(), lr=0.01, momentum=0.9)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
            train_side_by_side(model, opt, twin, opt_twin, x, loss_fn)
            for (name, p), q in zip(model.named_parameters(), twin.parameters()):
                for what, a, b in (("gradient", p.grad, q.grad), ("parameter", p, q)):
                    self.assertLessEqual((a - b).abs().max().item(),
                                         1e-9 * max(b.abs().max().item(), 1e-12),
                                         f"{kind}, use_cache={use_cache}: {what} {name}")
            plan.undo()
        self.assertLess(leasts[False], leasts[True])

    def test_gpt2(self):
        self.check("gpt2", "transformer.h", "attn", [("mlp.(c_fc..c_proj)", "sliced mlp")])

    def test_llama(self):
        self.check("llama", "model.layers", "self_attn",
                   [("mlp", "sliced mlp"), ("mlp.act_fn", "inplace swish")])

    def test_bert_mlps_split_between_two_modules_are_sliced(self):
        # transformers' encoders split each layer's MLP between two modules: BertIntermediate
        # (dense, then the activation) and BertOutput, whose dense takes its output (then
        # dropout and LayerNorm with the residual). fit slices it over its hidden features as
        # one (action path "(intermediate..output.dense)"), so neither checkpoint keeps the
        # hidden tensor (the intermediate's output, which a checkpoint of BertOutput kept):
        # at the least, and a budget halfway to the eager peak, the step kept (measured here,
        # = fit's), predicted within max(2 %, 1 MiB); three training steps at the least equal
        # the unfitted twin's (dropout masks included); the least below the one fit reaches
        # with BertOutput's dense not taken for the MLP's (a hook on it; fit slices no module
        # with hooks).
        transformers = optional_deps.require("transformers")
        ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))

        def make(hooked=False):
            torch.manual_seed(0)
            config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=1024,
                                             vocab_size=256, max_position_embeddings=64)
            model = transformers.BertForMaskedLM(config).double().train()
            if hooked:
                for layer in model.bert.encoder.layer:
                    layer.output.dense.register_forward_hook(lambda m, i, o: None)
            return model

        def loss_fn(out):
            return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), ids.flatten())

        def least_of(model, opt):
            with self.assertRaises(memlean.FitError) as error:
                memlean.fit(model, ids, 1, loss_fn=loss_fn, optimizer=opt)
            return error.exception.least_peak_bytes

        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        least = least_of(model, opt)
        eager = memlean.fit(model, ids, 2**50, loss_fn=loss_fn, optimizer=opt).eager_peak_bytes
        for budget in ((least + eager) // 2, least):
            plan = memlean.fit(model, ids, budget, loss_fn=loss_fn, optimizer=opt)
            self.assert_kept(plan, model, ids, loss_fn, opt, budget)
            plan.undo()
        done = {(a.path, a.action) for a in plan.actions}
        for i in range(2):
            self.assertIn((f"bert.encoder.layer.{i}.(intermediate..output.dense)", "sliced mlp"),
                          done, str(plan))
        hooked = make(hooked=True)
        self.assertLess(least, least_of(hooked, torch.optim.SGD(hooked.parameters(), lr=0.01,
                                                                 momentum=0.9)))
        # Training at the least, a fresh model beside its twin.
        model = make()
        twin = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        opt_twin = torch.optim.SGD(twin.parameters(), lr=0.01, momentum=0.9)
        plan = memlean.fit(model, ids, least, loss_fn=loss_fn, optimizer=opt)
        train_side_by_side(model, opt, twin, opt_twin, ids, loss_fn)
        # (Relative to each tensor's largest, or to 1e-6 of the largest gradient: the keys'
        # biases get none but rounding, attention being invariant to them.)
        largest = max(q.grad.abs().max().item() for q in twin.parameters())
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            for what, a, b in (("gradient", p.grad, q.grad), ("parameter", p, q)):
                self.assertLessEqual((a - b).abs().max().item(),
                                     1e-9 * max(b.abs().max().item(), 1e-6 * largest),
                                     f"{what} {name}")
        plan.undo()

    def test_bert_split_mlps_in_a_bfloat16_autocast_step_and_compiled(self):
        # The paths users take with a fitted encoder, float32: fit inside a bfloat16 autocast
        # region (each step in a region of its own) slices the split MLPs there too, and the
        # step keeps the least it names (measured here, predicted within max(2 %, 1 MiB));
        # three training steps at that least, each in autocast, equal the unfitted twin's
        # (to bfloat16's rounding: the sliced MLP sums its hidden slices' products in another
        # order); and the model fitted at its float32 least, compiled (aot_eager and inductor:
        # the sliced MLPs run unsliced there, as the plan says), trains as its twin does.
        transformers = optional_deps.require("transformers")
        ids = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0))

        def make():
            torch.manual_seed(0)
            # 1024 hidden features over 8 x 128 tokens: 2 MiB hidden tensors in bfloat16
            config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=1024,
                                             vocab_size=256, max_position_embeddings=128)
            return transformers.BertForMaskedLM(config).train()

        def loss_fn(out):
            return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(),
                                                     ids.flatten())

        def bf16():
            return torch.autocast("cpu", dtype=torch.bfloat16)

        def sgd(model):
            return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def least_plan(model, opt, region):
            # In bfloat16, checkpoints nested in checkpoints (compounds) reach a lower least
            # than slicing does (16,279,176 bytes; sliced, without compounds: 16,741,896), so
            # that the split MLPs are sliced there, fit plans without compounds.
            plain = plain_checkpoints()
            with contextlib.ExitStack() as stack:
                if region is bf16:
                    stack.enter_context(plain)
                with region(), self.assertRaises(memlean.FitError) as error:
                    memlean.fit(model, ids, 1, loss_fn=loss_fn, optimizer=opt)
                least = error.exception.least_peak_bytes
                with region():
                    plan = memlean.fit(model, ids, least, loss_fn=loss_fn, optimizer=opt)
            done = {(a.path, a.action) for a in plan.actions}
            for i in range(2):
                self.assertIn((f"bert.encoder.layer.{i}.(intermediate..output.dense)",
                               "sliced mlp"), done, str(plan))
            return least, plan

        def train_beside_twin(model, twin, region, rtol):
            opt, opt_twin = sgd(model), sgd(twin)
            for step in range(3):
                for m, o in ((model, opt), (twin, opt_twin)):
                    torch.manual_seed(100 + step)  # the same dropout masks
                    with region():
                        out = m(ids)
                    loss_fn(out).backward()
                    if step < 2:
                        o.step()
                        o.zero_grad()
            largest = max(q.grad.abs().max().item() for q in twin.parameters())
            for (name, p), q in zip(model.named_parameters(), twin.parameters()):
                # (relative to each tensor's largest, or to 1e-3 of the largest gradient: the
                # keys' biases get none but rounding, attention being invariant to them)
                scale = max(q.grad.abs().max().item(), 1e-3 * largest)
                self.assertLessEqual((p.grad - q.grad).abs().max().item(), rtol * scale, name)

        model = make()
        opt = sgd(model)
        least, plan = least_plan(model, opt, bf16)
        for _ in range(2):  # (the first makes the optimizer's state)
            with bf16():
                measured = step_peak(model, (ids,), loss_fn, opt)
        self.assertLessEqual(measured, least, str(plan))
        self.assertLessEqual(abs(plan.predicted_peak_bytes - measured),
                             max(measured // 50, 1 << 20), str(plan))
        plan.undo()
        model = make()
        twin = copy.deepcopy(model)
        least_plan(model, sgd(model), bf16)
        train_beside_twin(model, twin, bf16, 2e-2)
        from torch._inductor import config as inductor_config

        for backend in ("aot_eager", "inductor"):
            with self.subTest(backend=backend):
                model = make()
                twin = copy.deepcopy(model)
                # (inductor draws dropout masks its own way unless told to draw eager's)
                with warnings.catch_warnings(), inductor_config.patch(fallback_random=True):
                    warnings.simplefilter("ignore")  # (eager-only runs: the plan says so)
                    least_plan(model, sgd(model), contextlib.nullcontext)
                    train_beside_twin(torch.compile(model, backend=backend), twin,
                                      contextlib.nullcontext, 1e-4)
                torch._dynamo.reset()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="comma-separated torchvision model names")
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=4)
    args, rest = parser.parse_known_args()
    if not args.models:
        unittest.main(argv=[sys.argv[0]] + rest)
        return
    torch.set_num_threads(2)
    case = FitZooTest()
    for name in args.models.split(","):
        least, eager, rows = case.check(name, args.size, args.batch)
        print(f"{name}: eager {eager:,} bytes, least {least:,} ({least / eager:.3f}); "
              "kept, measured = fit's, training equal", flush=True)
        for budget, peak, predicted, actions in rows:
            print(f"  budget {budget:,}: peak {peak:,}, predicted {predicted:,} "
                  f"({predicted / peak - 1:+.2%}), {actions} actions", flush=True)


if __name__ == "__main__":
    main()
