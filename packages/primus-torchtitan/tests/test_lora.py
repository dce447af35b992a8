"""LoRA (``train.lora``) on the TorchTitan backend (:mod:`primus.torchtitan.lora`): the base frozen, core's adapters
on torchtitan's linears in every layout, checkpoints of the adapters alone, and their export by HF name.

The runs (configs/lora.yaml: tiny-demo's Llama, rank-4 adapters on every projection, fp32 on CPU, 6 steps at a
constant LR from the canonical init), each made once per module:

- ``ws1``: one rank, a checkpoint every 3 steps, the model as trained dumped at the end (drive.py);
- ``fsdp2`` / ``tp2`` / ``ddp2``: two gloo ranks; ``resumed``: one rank from ws1's step-3 checkpoint;
- ``bf16``: two ranks, FSDP in bf16, 2 steps, the model dumped.

Tolerances: the layouts train ws1's curve within test_same_run's ``LOSS_RTOL`` (fp32 reduction order only;
measured within 1e-7); a resume continues it within 1e-6 (measured equal).
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from conftest import CONFIGS, drive, metrics, primus_train, summary

from primus.core.hf import lora as core
from primus.core.hf.contract import hf_names
from primus.core.launch.resolve import resolve
from primus.core.run import initial_weights as init
from primus.torchtitan import lora
from primus.torchtitan.hf import INTEROP, adapter, build_model

CONFIG = str(CONFIGS / "lora.yaml")
LOSS_RTOL, GNORM_RTOL, RESUME_TOL = 2e-5, 1e-4, 1e-6
LAYOUTS = {
    "fsdp2": ["parallel.dp_shard=2"],
    "tp2": ["parallel.tp=2"],
    "ddp2": ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
}
QWEN3 = ("model.family=qwen3", "model.qk_norm=true", "model.head_dim=64")
QWEN2 = ("model.family=qwen2", "model.qkv_bias=true", "model.tie_word_embeddings=true")


def config(*overrides: str):
    return resolve(CONFIG, list(overrides), world_size=1).config


def canonical_base(cfg) -> dict[str, torch.Tensor]:
    """The canonical initial weights in torchtitan's names and layout (what the run's frozen base must stay)."""
    m = cfg.model
    return adapter(cfg).from_hf({n: init.tensor(n, m, cfg.train.seed) for n in hf_names(m)})


@pytest.fixture(scope="module")
def ws1(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "ws1"
    proc = drive(CONFIG, out, "checkpoint.interval=3", env={"PRIMUS_TEST_DUMP_MODEL": str(out.parent / "ws1.pt")})
    return {
        "out": out,
        "rows": metrics(out),
        "summary": summary(proc),
        "log": proc.stderr,
        "model": out.parent / "ws1.pt",
    }


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root, done = tmp_path_factory.mktemp("lora_layouts"), {}

    def get(name: str) -> list[dict]:
        if name not in done:
            primus_train(CONFIG, root / name, *LAYOUTS[name], "checkpoint.enabled=false", nproc=2)
            done[name] = metrics(root / name)
        return done[name]

    return get


@pytest.mark.parametrize("model", [(), QWEN3, QWEN2], ids=["llama", "qwen3", "qwen2"])
def test_adapters_map_onto_torchtitan_layout(model):
    """With random adapters, the LoRA model's logits equal those of the plain model whose HF weights are merged
    ``W + s·B A`` (core's :func:`merged`): the adapters' rows land on torchtitan's rows of each projection (llama3
    permutes q / k for its interleaved RoPE; qwen3 does not; qwen2 runs on Primus's dense model, biased and tied)."""
    cfg = config(*model)
    m, scaling = cfg.model, cfg.train.lora.scaling
    hf = {n: init.tensor(n, m, cfg.train.seed) for n in hf_names(m)}
    gen = torch.Generator().manual_seed(0)
    values = {n: torch.randn(v.shape, generator=gen) * 0.2 for n, v in core.initial_tensors(cfg).items()}
    found = lora.targets(cfg)
    assert (found[0].rows is not None) == (m.family != "qwen3")  # q's rows permuted on llama3's layout only

    adapted = build_model(cfg)
    assert lora.attach(adapted, cfg, found) == len(found) == 7 * m.num_layers
    missing = adapted.load_state_dict(adapter(cfg).from_hf(dict(hf)), strict=False).missing_keys
    assert sorted(missing) == sorted(lora.checkpoint_keys(cfg))  # the adapters, nothing else
    with torch.no_grad():
        for t in found:
            module = adapted.get_submodule(t.path + lora.SUFFIX)
            module.lora_A.copy_(values[t.adapter.name(core.A)])
            module.lora_B.copy_(values[t.adapter.name(core.B)])
            module.place(torch.device("cpu"))
    merged = dict(hf)
    for a in core.adapters(m, cfg.train.lora):
        w = f"{a.module}.weight"
        merged[w] = core.merged(hf[w], values[a.name(core.A)], values[a.name(core.B)], scaling)
    plain, base = build_model(cfg), build_model(cfg)
    plain.load_state_dict(adapter(cfg).from_hf(merged))
    base.load_state_dict(adapter(cfg).from_hf(dict(hf)))
    ids = torch.randint(0, m.vocab_size, (2, 32), generator=gen)
    with torch.no_grad():
        got, want, without = adapted.eval()(ids), plain.eval()(ids), base.eval()(ids)
    assert (got - without).abs().max() > 0.5  # the adapters change the logits
    torch.testing.assert_close(got, want, rtol=0, atol=5e-5)


def test_only_the_adapters_train(ws1):
    cfg = config()
    rows, sd = ws1["rows"], torch.load(ws1["model"])
    loss = [r["loss"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, 7)) and loss[-1] < loss[0] - 0.1, loss
    keys = lora.checkpoint_keys(cfg)
    base = canonical_base(cfg)
    assert set(sd) == set(base) | set(keys)
    for k, v in base.items():  # frozen: bit-identical to where the run started
        assert torch.equal(sd[k], v), k
    initial = core.initial_tensors(cfg)
    for k, (name, _) in keys.items():  # trained: every adapter moved (B from zero)
        assert sd[k].dtype == torch.float32 and not torch.equal(sd[k], initial[name]), k
    trainable = sum(v.numel() for k, v in sd.items() if k in keys)
    assert ws1["summary"]["lora"] == {
        "trainable_params": trainable,
        "total_params": sum(v.numel() for v in sd.values()),
    }
    assert "LoRA: 18,688 trainable parameters of 912,256 (2.05%)" in ws1["log"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_the_one_rank_curve(name, ws1, layouts):
    ref, got = ws1["rows"], layouts(name)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=LOSS_RTOL)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=GNORM_RTOL)


def test_resume_continues_like_the_straight_run(ws1, tmp_path):
    """From the step-3 checkpoint (the adapters, their optimizer state, the data position): the base is rebuilt as
    the run started (the canonical init), the adapters loaded, and steps 4-6 are the straight run's."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ws1["out"] / "checkpoints" / "step_00000003", ckpt / "step_00000003")
    primus_train(CONFIG, tmp_path / "run", f"checkpoint.dir={ckpt}", resume=True)
    rows, straight = metrics(tmp_path / "run"), ws1["rows"][3:]
    assert [r["step"] for r in rows] == [4, 5, 6]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in straight], abs=RESUME_TOL)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in straight], rel=1e-5)


def test_checkpoint_holds_the_adapters_alone(ws1):
    """The model in a LoRA checkpoint is its adapters: no base tensor; the tensors held are the adapters and Adam's
    two moments of each (and scalars); on disk it is smaller than the frozen base alone."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    cfg = config()
    folder = ws1["out"] / "checkpoints" / "step_00000006"
    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    tensors = {k: v for k, v in meta.items() if isinstance(v, TensorStorageMetadata)}
    model = {k for k in meta if k.startswith("layers.") or k in canonical_base(cfg)}
    assert model == set(lora.checkpoint_keys(cfg))
    held = sum(v.size.numel() * v.properties.dtype.itemsize for v in tensors.values())
    adapters = 4 * sum(math.prod(shape) for _, shape in lora.checkpoint_keys(cfg).values())
    base = 4 * sum(v.numel() for v in canonical_base(cfg).values())
    assert 3 * adapters <= held < 3 * adapters + 4096  # the adapters, exp_avg, exp_avg_sq; Adam's steps
    on_disk = sum(f.stat().st_size for f in folder.iterdir())
    assert on_disk < base / 3, (on_disk, base)  # (a full checkpoint holds 3 × base: weights and two moments)


def test_export_adapters_gives_the_trained_adapters_by_hf_name(ws1, tmp_path):
    """``export_adapters`` (``primus checkpoint export`` of a LoRA run): exactly core's names and shapes, the values
    the run trained; a PEFT folder of them is what ``train.lora.init_from`` starts the adapters from."""
    from primus.core.hf.contract import OFFLINE_OVERRIDES
    from primus.core.hf.peft import write_adapter

    cfg = resolve(str(ws1["out"] / "config.yaml"), list(OFFLINE_OVERRIDES), world_size=1).config
    got = INTEROP.export_adapters(cfg, ws1["out"] / "checkpoints")  # the newest: step 6
    names = core.tensor_names(cfg.model, cfg.train.lora)
    assert list(got) == names
    sd = torch.load(ws1["model"])
    for key, (name, shape) in lora.checkpoint_keys(cfg).items():
        assert got[name].dtype == torch.float32 and tuple(got[name].shape) == shape
        assert torch.equal(got[name], sd[key]), name
    folder = write_adapter(tmp_path / "peft", got, cfg)
    started = lora.initial_values(config(f"train.lora.init_from={folder}"))
    assert all(torch.equal(started[n], got[n]) for n in names)


def test_bf16_keeps_the_base_in_bf16_and_trains_fp32_adapters(tmp_path):
    """A bf16 run under FSDP: the frozen base is held in bf16 (the canonical init rounded once, then untouched), the
    adapters train in fp32 master weights."""
    dump = tmp_path / "model.pt"
    overrides = ["train.precision=bf16", "parallel.dp_shard=2", "train.steps=2", "checkpoint.enabled=false"]
    drive(CONFIG, tmp_path / "run", *overrides, nproc=2, env={"PRIMUS_TEST_DUMP_MODEL": str(dump)})
    cfg, sd = config(), torch.load(dump)
    keys = lora.checkpoint_keys(cfg)
    for k, v in canonical_base(cfg).items():
        assert sd[k].dtype == torch.bfloat16 and torch.equal(sd[k], v.to(torch.bfloat16)), k
    initial = core.initial_tensors(cfg)
    for k, (name, _) in keys.items():
        assert sd[k].dtype == torch.float32 and not torch.equal(sd[k], initial[name]), k
    assert all(r["loss"] > 0 for r in metrics(tmp_path / "run"))


def test_fp8_with_lora_is_refused():
    from primus.core.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        config("kernels.fp8=tensorwise")
    text = " ".join(str(err.value).split())
    assert "kernels.fp8" in text and "train.lora's adapters hook torchtitan's linears" in text, text
