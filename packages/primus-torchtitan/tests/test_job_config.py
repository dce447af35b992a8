"""The Primus config -> torchtitan JobConfig mapping (primus.torchtitan.job_config): what it sets exists in
torchtitan 0.2.2's JobConfig, the names validation checks against are the installed JobConfig's, and the module
imports neither torch nor torchtitan."""

from __future__ import annotations

import subprocess
import sys

import pytest

from primus.torchtitan import job_config


def test_imports_neither_torch_nor_torchtitan():
    # a fresh interpreter: the tests' conftest has imported both here
    code = (
        "import sys\n"
        "import primus.torchtitan.job_config, primus.torchtitan.validate\n"
        "assert 'torch' not in sys.modules and 'torchtitan' not in sys.modules, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchtitan'))[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_sections_are_the_installed_job_configs():
    from primus.torchtitan import validate

    assert set(job_config.job_config_fields()) == job_config.JOB_CONFIG_SECTIONS
    assert validate.JOB_CONFIG_SECTIONS is job_config.JOB_CONFIG_SECTIONS  # validation reuses the mapping's


def test_pipeline_schedule_names_are_the_configs():
    import typing

    from primus.core.config.schema import ParallelConfig

    names = typing.get_args(ParallelConfig.model_fields["pp_schedule"].annotation)
    assert set(names) == set(job_config.PP_SCHEDULES)


def test_job_config_fields_primus_sets_exist():
    fields = job_config.job_config_fields()
    for section, names in {
        "training": {
            "local_batch_size",
            "global_batch_size",
            "seq_len",
            "steps",
            "max_norm",
            "dtype",
            "mixed_precision_param",
            "mixed_precision_reduce",
        },
        "parallelism": {
            "data_parallel_replicate_degree",
            "data_parallel_shard_degree",
            "fsdp_reshard_after_forward",
            "tensor_parallel_degree",
            "pipeline_parallel_degree",
            "pipeline_parallel_schedule",
            "pipeline_parallel_microbatch_size",
            "module_fqns_per_model_part",
            "context_parallel_degree",
        },
        "checkpoint": {
            "enable",
            "folder",
            "interval",
            "keep_latest_k",
            "last_save_model_only",
        },
        "lr_scheduler": {"warmup_steps", "decay_type", "decay_ratio", "min_lr_factor", "total_steps"},
        "optimizer": {"name", "lr", "eps", "weight_decay", "beta1", "beta2", "implementation"},
        "activation_checkpoint": {"mode", "selective_ac_option"},
    }.items():
        assert names <= fields[section], names - fields[section]


def test_pipeline_schedules_exist():
    from torch.distributed.pipelining.schedules import get_schedule_class

    for name in job_config.PP_SCHEDULES.values():
        assert get_schedule_class(name) is not None


def test_stage_split():
    assert job_config.llama3_fqns_per_stage(2, 2) == [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    assert job_config.llama3_fqns_per_stage(4, 5)[0] == ["tok_embeddings", "layers.0", "layers.1"]


def test_apply_overrides_nested_and_dotted():
    jc = job_config.new_job_config()
    job_config.apply_overrides(jc, {"checkpoint": {"folder": "x"}, "training.gc_freq": 7})
    assert jc.checkpoint.folder == "x" and jc.training.gc_freq == 7
    with pytest.raises(KeyError, match="no field"):
        job_config.apply_overrides(jc, {"checkpoint": {"nope": 1}})


def test_extra_value_nested_or_dotted():
    assert job_config.extra_value({"checkpoint": {"create_seed_checkpoint": True}}, "checkpoint.create_seed_checkpoint")
    assert job_config.extra_value({"checkpoint.create_seed_checkpoint": True}, "checkpoint.create_seed_checkpoint")
    assert job_config.extra_value({}, "checkpoint.create_seed_checkpoint", False) is False
