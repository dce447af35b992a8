"""LoRA (``train.lora``) on core's side, no engine: PEFT's adapter folder out (``write_adapter``: PEFT loads it on the
transformers model with no missing or unexpected keys, and its logits are the base model's with ``W + s·B A``) and in
(``read_adapter``: a folder PEFT itself saved; its refusals by key); the merge against PEFT's ``merge_and_unload``;
``primus checkpoint export`` of a LoRA checkpoint through a backend's ``export_adapters`` (the adapter folder,
``--merge``'s full folder, refusals); the config's refusals; the planner's frozen base and fp32 adapters.

The model is tiny-llama's shape (transformers' Llama built from core's ``config.json``), its weights core's canonical
initial ones: the base a LoRA run without ``train.init_from`` names."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from conftest import FakeBackends  # noqa: E402

from primus.core import hookimpl  # noqa: E402
from primus.core.config.errors import ConfigError  # noqa: E402
from primus.core.config.schema import LORA_TARGETS  # noqa: E402
from primus.core.contracts.errors import UserError  # noqa: E402
from primus.core.contracts.plugins import DISABLE_ENV, Registry, build_plugin_manager  # noqa: E402
from primus.core.hf import lora  # noqa: E402
from primus.core.hf.config import hf_config  # noqa: E402
from primus.core.hf.contract import hf_names  # noqa: E402
from primus.core.hf.peft import CONFIG, PREFIX, WEIGHTS, AdapterError, merge, read_adapter, write_adapter  # noqa: E402
from primus.core.hf.safetensors_io import write_hf  # noqa: E402
from primus.core.launch.export import export as export_checkpoint  # noqa: E402
from primus.core.launch.resolve import resolve  # noqa: E402
from primus.core.run import initial_weights as init  # noqa: E402

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


class LoRABackend:
    """The fake backend with a Hugging Face exporter whose checkpoints are files of adapters (``adapters.pt``)."""

    @staticmethod
    @hookimpl
    def primus_backends():
        return [dataclasses.replace(spec, hf="test_lora_peft:FAKE_HF") for spec in FakeBackends.primus_backends()]


class FakeHF:
    """An engine's HF interop: a LoRA checkpoint is ``adapters.pt`` (HF names -> tensors); a full one ``model.pt``."""

    def import_hf(self, cfg, hf_dir, out):
        raise NotImplementedError

    def export_hf(self, cfg, checkpoint: Path):
        return torch.load(checkpoint / "model.pt")

    def export_adapters(self, cfg, checkpoint: Path):
        return torch.load(checkpoint / "adapters.pt")


FAKE_HF = FakeHF()


@pytest.fixture
def lora_registry(monkeypatch) -> Registry:
    monkeypatch.setenv(DISABLE_ENV, "1")
    return Registry(build_plugin_manager(extra_plugins=[("fake-backend", LoRABackend)]))


def _cfg(registry, *overrides: str, preset: str = "tiny-llama"):
    words = ["backend.name=fake", "train.precision=fp32", "train.lora.rank=4", "train.lora.alpha=8"]
    words.append("train.lora.target_modules=" + json.dumps(TARGETS))
    return resolve(preset, [*words, *overrides], world_size=1, registry=registry).config


def _trained(cfg, seed: int = 1) -> dict[str, torch.Tensor]:
    """Adapters as after training: PEFT's initial A, and a B that is no longer zero."""
    gen = torch.Generator().manual_seed(seed)
    out = lora.initial_tensors(cfg)
    return {
        n: (torch.randn(t.shape, generator=gen) * 0.05 if n.endswith("lora_B.weight") else t) for n, t in out.items()
    }


def _canonical(cfg) -> dict[str, torch.Tensor]:
    return {n: init.tensor(n, cfg.model, cfg.train.seed) for n in hf_names(cfg.model)}


def _hf_model(cfg, weights: dict[str, torch.Tensor]):
    config = transformers.AutoConfig.for_model(**hf_config(cfg.model, "float32"))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if cfg.model.tie_word_embeddings:
        model.tie_weights()
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids()).logits


def _by_hand(cfg, base, adapters) -> dict[str, torch.Tensor]:
    """W + (alpha / rank) B A for each adapted projection, written out here."""
    out = dict(base)
    s = cfg.train.lora.alpha / cfg.train.lora.rank
    for a in lora.adapters(cfg.model, cfg.train.lora):
        w = a.module + ".weight"
        out[w] = base[w] + s * adapters[a.name("lora_B")] @ adapters[a.name("lora_A")]
    return out


def test_peft_loads_the_adapter_folder_with_the_merged_logits(lora_registry, tmp_path):
    cfg = _cfg(lora_registry)
    base, adapters = _canonical(cfg), _trained(cfg)
    folder = write_adapter(tmp_path / "adapter", adapters, cfg, base="my-base")
    settings = json.loads((folder / CONFIG).read_text())
    assert (settings["peft_type"], settings["task_type"], settings["r"], settings["lora_alpha"]) == (
        "LORA",
        "CAUSAL_LM",
        4,
        8,
    )
    assert settings["base_model_name_or_path"] == "my-base" and sorted(settings["target_modules"]) == sorted(TARGETS)

    # every key of the file lands on a module of the PEFT model, and no adapter of the PEFT model is left unloaded
    loaded_config = peft.LoraConfig.from_pretrained(str(folder))
    bare = peft.get_peft_model(_hf_model(cfg, base), loaded_config)
    from safetensors.torch import load_file

    result = peft.set_peft_model_state_dict(bare, load_file(str(folder / WEIGHTS)))
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]

    model = peft.PeftModel.from_pretrained(_hf_model(cfg, base), str(folder)).eval()
    want = _logits(_hf_model(cfg, _by_hand(cfg, base, adapters)))
    got = _logits(model)
    assert (got - want).abs().max().item() < 1e-5
    assert (want - _logits(_hf_model(cfg, base))).abs().max().item() > 1e-3  # the adapters change the logits


def test_peft_loads_a_moe_models_attention_adapters(lora_registry, tmp_path):
    """A mixture-of-experts model's adapters are its attention's: the MLP's names match nothing in a routed layer, as
    PEFT finds no gate / up / down_proj in transformers 5's fused experts. PEFT loads the folder on the model read from
    its HF folder and gives the merged model's logits."""
    cfg = _cfg(lora_registry, "train.lora.target_modules=" + json.dumps(list(LORA_TARGETS)), preset="tiny-qwen3-moe")
    assert [a.role for a in lora.adapters(cfg.model, cfg.train.lora)][:4] == ["q", "k", "v", "o"]
    assert {a.role for a in lora.adapters(cfg.model, cfg.train.lora)} == {"q", "k", "v", "o"}
    base, adapters = _canonical(cfg), _trained(cfg)
    config = hf_config(cfg.model, "float32")
    write_hf(tmp_path / "base", base, config)
    write_hf(tmp_path / "merged", merge(base, adapters, cfg), config)
    folder = write_adapter(tmp_path / "adapter", adapters, cfg, base=str(tmp_path / "base"))

    def hf(path):
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    got, want = (
        _logits(peft.PeftModel.from_pretrained(hf(tmp_path / "base"), str(folder))),
        _logits(hf(tmp_path / "merged")),
    )
    assert (got - want).abs().max().item() < 1e-5
    assert (want - _logits(hf(tmp_path / "base"))).abs().max().item() > 1e-3


def test_read_adapter_takes_what_peft_saved(lora_registry, tmp_path):
    cfg = _cfg(lora_registry)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, task_type="CAUSAL_LM")
    model = peft.get_peft_model(_hf_model(cfg, _canonical(cfg)), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(tmp_path / "saved"))
    read = read_adapter(tmp_path / "saved", cfg)
    assert sorted(read) == sorted(lora.tensor_names(cfg.model, cfg.train.lora))
    params = dict(model.named_parameters())
    for name, t in read.items():
        module, which = name.removesuffix(".weight").rsplit(".", 1)
        assert t.dtype == torch.float32
        assert torch.equal(t, params[f"{PREFIX}{module}.{which}.default.weight"].detach())


def test_read_adapter_round_trip(lora_registry, tmp_path):
    cfg = _cfg(lora_registry)
    adapters = _trained(cfg)
    write_adapter(tmp_path / "a", adapters, cfg)
    read = read_adapter(tmp_path / "a", cfg)
    assert list(read) == lora.tensor_names(cfg.model, cfg.train.lora)
    assert all(torch.equal(read[n], adapters[n]) for n in adapters)


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["train.lora.rank=8"], "r is 4 in adapter_config.json, train.lora.rank is 8"),
        (["train.lora.alpha=16"], "lora_alpha is 8 in adapter_config.json, train.lora.alpha is 16"),
        (['train.lora.target_modules=["q_proj","v_proj"]'], "target_modules is ['q_proj', 'v_proj', 'o_proj'"),
    ],
)
def test_read_adapter_refuses_other_settings(lora_registry, tmp_path, overrides, said):
    write_adapter(tmp_path / "a", _trained(_cfg(lora_registry)), _cfg(lora_registry))
    with pytest.raises(AdapterError) as err:
        read_adapter(tmp_path / "a", _cfg(lora_registry, *overrides))
    assert said in str(err.value) and "train.lora.init_from" in str(err.value)


def test_read_adapter_refuses_other_tensors(lora_registry, tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = _cfg(lora_registry)
    folder = write_adapter(tmp_path / "a", _trained(cfg), cfg)
    state = load_file(str(folder / WEIGHTS))
    name = PREFIX + "model.layers.1.self_attn.q_proj.lora_A.weight"

    save_file({**state, name: torch.zeros(4, 64)}, str(folder / WEIGHTS))
    with pytest.raises(AdapterError, match=r"q_proj.lora_A.weight has shape \[4, 64\] .* has \[4, 128\]"):
        read_adapter(folder, cfg)
    save_file({k: v for k, v in state.items() if k != name}, str(folder / WEIGHTS))
    with pytest.raises(AdapterError, match=r"lacks 1 adapter tensor\(s\)"):
        read_adapter(folder, cfg)
    save_file(
        {**state, PREFIX + "model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(4, 128)}, str(folder / WEIGHTS)
    )
    with pytest.raises(AdapterError, match="none of the model's adapters"):
        read_adapter(folder, cfg)
    settings = json.loads((folder / CONFIG).read_text())
    (folder / CONFIG).write_text(json.dumps({**settings, "use_rslora": True}))
    with pytest.raises(AdapterError, match="use_rslora is True"):
        read_adapter(folder, cfg)
    with pytest.raises(AdapterError, match="not a PEFT adapter folder: no such folder"):
        read_adapter(tmp_path / "nowhere", cfg)


def test_merge_is_peft_merge_and_unload(lora_registry, tmp_path):
    cfg = _cfg(lora_registry)
    base, adapters = _canonical(cfg), _trained(cfg)
    folder = write_adapter(tmp_path / "a", adapters, cfg)
    merged_by_peft = peft.PeftModel.from_pretrained(_hf_model(cfg, base), str(folder)).merge_and_unload().state_dict()
    mine = merge(base, adapters, cfg)
    assert sorted(mine) == sorted(hf_names(cfg.model))
    for name, t in mine.items():
        torch.testing.assert_close(t, merged_by_peft[name], rtol=0, atol=1e-6)
    assert not torch.equal(
        mine["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(mine["model.layers.0.self_attn.k_proj.weight"], base["model.layers.0.self_attn.k_proj.weight"])


def _checkpoint(tmp_path: Path, name: str, tensors: dict, file: str = "adapters.pt") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    torch.save(tensors, folder / file)
    return folder


def test_export_writes_the_adapter_folder_and_merge_the_full_model(lora_registry, tmp_path):
    cfg = _cfg(lora_registry)
    base, adapters = _canonical(cfg), _trained(cfg)
    ckpt = _checkpoint(tmp_path, "step_3", adapters)

    out = export_checkpoint(cfg, ckpt, tmp_path / "peft", registry=lora_registry)
    assert (out / CONFIG).is_file() and (out / "tokenizer.json").is_file() and not (out / "config.json").exists()
    peft_logits = _logits(peft.PeftModel.from_pretrained(_hf_model(cfg, base), str(out)).eval())

    merged = export_checkpoint(cfg, ckpt, tmp_path / "merged", merge=True, registry=lora_registry)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    assert (_logits(model) - peft_logits).abs().max().item() < 1e-5

    # a base in a Hugging Face folder (train.init_from): merged into it, and named in the adapter's config
    other = {n: t + 0.01 for n, t in base.items()}
    write_hf(tmp_path / "base", other, hf_config(cfg.model, "float32"))
    out = export_checkpoint(cfg, ckpt, tmp_path / "peft2", base=str(tmp_path / "base"), registry=lora_registry)
    assert json.loads((out / CONFIG).read_text())["base_model_name_or_path"] == str((tmp_path / "base").absolute())
    merged = export_checkpoint(
        cfg, ckpt, tmp_path / "merged2", merge=True, base=str(tmp_path / "base"), registry=lora_registry
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    want = _logits(peft.PeftModel.from_pretrained(_hf_model(cfg, other), str(out)).eval())
    assert (_logits(model) - want).abs().max().item() < 1e-5


def test_export_refusals(lora_registry, tmp_path):
    plain = resolve("tiny-llama", ["backend.name=fake"], world_size=1, registry=lora_registry).config
    ckpt = _checkpoint(tmp_path, "step_1", _canonical(plain), "model.pt")
    with pytest.raises(UserError, match="not a LoRA run's checkpoint"):
        export_checkpoint(plain, ckpt, tmp_path / "x", merge=True, registry=lora_registry)
    cfg = _cfg(lora_registry)
    with pytest.raises(UserError, match="the run's base .*no such file or folder"):
        export_checkpoint(cfg, ckpt, tmp_path / "y", merge=True, base=str(tmp_path / "gone"), registry=lora_registry)


def test_export_cli(lora_registry, cli_lora, tmp_path):
    """``primus checkpoint export`` of a LoRA run's checkpoint: the PEFT folder; --merge the full model; --merge of
    another run's refused in one line."""
    import yaml
    from typer.testing import CliRunner

    from primus.core.cli import app as cli
    from primus.core.run import checkpoints

    cfg = _cfg(lora_registry)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    ckpt = checkpoints.NAMING.folder(run / "checkpoints", 3)
    man = checkpoints.manifest(cfg, 3, {}, [])
    checkpoints.atomic_save(ckpt, man, 0, lambda tmp: torch.save(_trained(cfg), tmp / "adapters.pt"), lambda: None)
    runner = CliRunner()
    res = runner.invoke(cli.app, ["checkpoint", "export", str(ckpt), "--to-hf", str(tmp_path / "peft")])
    assert res.exit_code == 0, res.output
    assert "PEFT LoRA adapter" in res.output and (tmp_path / "peft" / CONFIG).is_file()
    res = runner.invoke(cli.app, ["checkpoint", "export", str(ckpt), "--to-hf", str(tmp_path / "full"), "--merge"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "full" / "config.json").is_file()

    plain = resolve("tiny-llama", ["backend.name=fake"], world_size=1, registry=lora_registry).config
    (run / "config.yaml").write_text(yaml.safe_dump(plain.model_dump(mode="json"), sort_keys=False))
    res = runner.invoke(cli.app, ["checkpoint", "export", str(ckpt), "--to-hf", str(tmp_path / "no"), "--merge"])
    assert res.exit_code == 2 and "not a LoRA run's checkpoint" in res.output


@pytest.fixture
def cli_lora(lora_registry, monkeypatch):
    from primus.core.contracts import plugins

    monkeypatch.setattr(plugins, "_cached", lora_registry)
    return lora_registry


# --- the config's refusals ---------------------------------------------------------------------------------------


def _refused(registry, preset: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(preset, ["backend.name=fake", *overrides], world_size=1, registry=registry)
    return str(err.value)


def test_config_refusals(lora_registry, tmp_path):
    text = _refused(lora_registry, "tiny-deepseek", "train.lora.rank=4")
    assert "train.lora" in text and "model.mla" in text
    mlp = "train.lora.target_modules=" + json.dumps(["gate_proj", "up_proj"])
    text = _refused(lora_registry, "tiny-qwen3-moe", "train.lora.rank=4", mlp)
    assert "train.lora.target_modules" in text and "match no projection" in text and "routed experts" in text
    text = _refused(lora_registry, "tiny-llama", "train.lora.rank=4", "train.init=engine")
    assert "train.init" in text and "cannot be named" in text
    text = _refused(lora_registry, "tiny-llama", f"train.lora.init_from={tmp_path}")
    assert "train.lora.init_from" in text and "has no adapter_config.json" in text
    cfg = _cfg(lora_registry)
    write_adapter(tmp_path / "a", _trained(cfg), cfg)
    text = _refused(lora_registry, "tiny-llama", "train.lora.rank=8", f"train.lora.init_from={tmp_path / 'a'}")
    assert "train.lora.init_from" in text and "r is 4 in adapter_config.json, train.lora.rank is 8" in text
    ok = _cfg(lora_registry, f"train.lora.init_from={tmp_path / 'a'}")
    assert ok.train.lora.init_from == str(tmp_path / "a")


# --- the planner -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["llama3.2-1b", "qwen2.5-3b"])
def test_planner_freezes_the_base_and_trains_fp32_adapters(lora_registry, preset):
    from primus.core.config.presets import model_config
    from primus.core.config.schema import LoRAConfig
    from primus.core.planner import GENERIC, Layout, estimate
    from primus.core.planner.modelmath import count_params

    m = model_config(preset, lora_registry)
    cfg = LoRAConfig(rank=16, alpha=32)
    p = count_params(m).total
    h, f, L = m.hidden_size, m.ffn_hidden_size, m.num_layers
    q, kv = m.num_attention_heads * m.kv_channels, m.num_kv_heads * m.kv_channels
    # rank · (in + out) of q, k, v, o, gate, up, down in every layer
    per_layer = 16 * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h))
    n_adapters = L * per_layer
    layout = Layout("generic", "ddp", dp=1, profile=GENERIC)
    full = estimate(m, layout, 4096).parts
    mine = estimate(m, layout, 4096, lora=cfg).parts
    assert (mine["weights"], mine["gradients"], mine["optimizer"]) == (
        2 * p + 4 * n_adapters,  # the base in bf16, the adapters in fp32
        4 * n_adapters,
        8 * n_adapters,  # Adam's m and v; fp32 adapters are their own master copy
    )
    assert (full["weights"], full["gradients"], full["optimizer"]) == (2 * p, 4 * p, 12 * p)
    # the adapters' activations: each one's A x (rank elements a token) on top of the layer's
    extra = mine["activations"] - full["activations"]
    assert extra == pytest.approx(2 * 4096 * L * 16 * 7)
    assert sum(mine.values()) < 0.5 * sum(full.values())

    # FSDP over 8 shards all of it; fp32 runs hold the base in fp32
    fsdp = estimate(m, Layout("generic", "fsdp", dp=8, profile=GENERIC), 4096, lora=cfg).parts
    assert fsdp["optimizer"] == pytest.approx(8 * n_adapters / 8)
    assert fsdp["weights"] == pytest.approx((2 * p + 4 * n_adapters) / 8)
    fp32 = estimate(m, layout, 4096, "fp32", lora=cfg).parts
    assert fp32["weights"] == 4 * p + 4 * n_adapters


def test_plan_of_a_lora_run_uses_the_lora_estimate(lora_registry):
    from primus.core.planner.strategies import estimate_memory

    plain = resolve("llama3.2-1b", ["backend.name=fake"], world_size=1, registry=lora_registry).config
    mine = resolve("llama3.2-1b", ["backend.name=fake", "train.lora.rank=8"], world_size=1, registry=lora_registry)
    a = estimate_memory(plain, 1, lora_registry)
    b = estimate_memory(mine.config, 1, lora_registry)
    assert b.total < a.total
    assert b.parts["gradients"] < 0.01 * a.parts["gradients"]


def test_planner_step_time_and_flops_of_a_lora_run(lora_registry):
    """Frozen base weights have no weight gradient: 4 FLOPs a weight and token instead of 6 (the input gradient still
    runs through them), the adapters 6; attention's backward is whole. The optimizer steps the adapters alone and
    their fp32 gradients are all DDP reduces; FSDP still gathers the frozen weights."""
    from primus.core.config.presets import model_config
    from primus.core.config.schema import LoRAConfig
    from primus.core.planner import GENERIC, Layout, device
    from primus.core.planner.calibration import LOSS_BYTES_PER_LOGIT
    from primus.core.planner.modelmath import count_params, flops_per_token, matmul_params
    from primus.core.planner.perf import gemm_rate, layer_seconds_per_token, step_time

    m = model_config("llama3.2-1b", lora_registry)
    cfg = LoRAConfig(rank=16, alpha=32)
    h, f, L, V = m.hidden_size, m.ffn_hidden_size, m.num_layers, m.vocab_size
    q, kv = m.num_attention_heads * m.kv_channels, m.num_kv_heads * m.kv_channels
    n_adapters = L * 16 * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h))
    full_flops, lora_flops = flops_per_token(m, 4096), flops_per_token(m, 4096, cfg)
    attention = full_flops - 6 * matmul_params(m)
    assert lora_flops == pytest.approx(4 * matmul_params(m) + 6 * n_adapters + attention)

    dev = device("H100")
    full_layer = layer_seconds_per_token(m, 4096, dev)
    lora_layer = layer_seconds_per_token(m, 4096, dev, lora=cfg)
    adapters_s = 6 * n_adapters / L / gemm_rate(dev)
    assert lora_layer["gemm"] - adapters_s == pytest.approx(4 / 6 * full_layer["gemm"])
    assert {k: v for k, v in lora_layer.items() if k != "gemm"} == {k: v for k, v in full_layer.items() if k != "gemm"}

    ddp = Layout("generic", "ddp", dp=8, micro_batch=2, profile=GENERIC)
    full, mine = step_time(m, ddp, 4096, 16, dev, 8), step_time(m, ddp, 4096, 16, dev, 8, lora=cfg)
    hbm = dev.step_hbm_gbps * 1e9
    head = (6 * V * h, 4 * V * h)
    loss = LOSS_BYTES_PER_LOGIT * V / hbm
    per_token = [
        L * sum(layer.values()) + w / gemm_rate(dev) + loss
        for layer, w in zip((full_layer, lora_layer), head, strict=True)
    ]
    optimizer = [GENERIC.optimizer_bytes_per_param * n / hbm for n in (count_params(m).total, n_adapters)]
    for t, token_s, opt in zip((full, mine), per_token, optimizer, strict=True):
        assert t.compute == pytest.approx(2 * 4096 * token_s + opt)  # one micro-batch of 2 × 4096 tokens a device
    assert mine.dp_comm < 0.01 * full.dp_comm  # fp32 adapters' gradients, not the model's
    assert 0.6 < mine.total / full.total < 0.75
    fsdp = Layout("generic", "fsdp", dp=8, micro_batch=2, profile=GENERIC)
    # FSDP gathers the frozen weights all the same: the gather is most of its traffic either way
    frozen, trained = step_time(m, fsdp, 4096, 16, dev, 8, lora=cfg), step_time(m, fsdp, 4096, 16, dev, 8)
    assert 0.5 < frozen.dp_comm / trained.dp_comm < 1.0
