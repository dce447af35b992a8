"""primus slurm: the sbatch script, submission through sbatch, refusal of bad configs before queueing."""

from __future__ import annotations

import os
import stat

from typer.testing import CliRunner

from primus.core.cli import app as cli
from primus.core.launch.env import AMD, COMMON, NVIDIA
from primus.core.launch.launcher import torchrun_command

runner = CliRunner()


def test_script_runs_torchrun_per_node_with_env(tmp_path, cli_registry):
    exp = tmp_path / "exp.yaml"
    exp.write_text("extends: [tiny-llama]\nbackend: {name: fake}\n")
    path = tmp_path / "job.sh"
    res = runner.invoke(
        cli.app,
        [
            "slurm",
            "script",
            str(exp),
            "train.steps=7",
            "--nodes",
            "4",
            "--gpus-per-node",
            "8",
            "--family",
            "amd",
            "--env",
            "NCCL_SOCKET_IFNAME=ens1",
            "--partition",
            "gpu",
            "--out",
            str(path),
        ],
    )
    assert res.exit_code == 0, res.output
    text = path.read_text()
    assert os.stat(path).st_mode & stat.S_IXUSR
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --partition=gpu",
        "export NCCL_SOCKET_IFNAME=ens1  # --env",
    ):
        assert line in text
    for key in {**COMMON, **AMD}:
        assert f"export {key}=${{{key}:-" in text
    assert not any(f"export {k}=" in text for k in NVIDIA)
    srun = next(ln for ln in text.splitlines() if ln.startswith("srun"))
    assert "--nnodes=$SLURM_NNODES --nproc-per-node=8" in srun and "--rdzv-endpoint=$head:29500" in srun
    # absolute path (compute nodes share the FS); a requeued job resumes, the user's overrides win
    assert srun.endswith(f"train {exp.resolve()} checkpoint.resume=auto train.steps=7 &")
    for line in ("#SBATCH --signal=B:USR1@300", "#SBATCH --requeue", 'scontrol requeue "$SLURM_JOB_ID"'):
        assert line in text


def test_script_passes_the_time_limit_signal_to_the_run_and_requeues(tmp_path, cli_registry):
    """The script run by bash with stand-ins for srun / scontrol: SIGUSR1 to the batch shell reaches the job step,
    which exits; the job is requeued once."""
    import signal
    import subprocess
    import time

    exp = tmp_path / "exp.yaml"
    exp.write_text("extends: [tiny-llama]\nbackend: {name: fake}\n")
    path = tmp_path / "job.sh"
    assert runner.invoke(cli.app, ["slurm", "script", str(exp), "--out", str(path)]).exit_code == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    stand_ins = {  # srun: a job step that exits 75 on SIGUSR1; scontrol: hostnames, and a logged requeue
        "srun": f"#!/bin/bash\ntrap 'echo srun got USR1 >> {log}; exit 75' USR1\nwhile true; do sleep 0.1; done\n",
        "scontrol": f'#!/bin/bash\nif [ "$1" = show ]; then echo node0; else echo "scontrol $*" >> {log}; fi\n',
    }
    for name, text in stand_ins.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "n0",
        "SLURM_NNODES": "1",
    }
    proc = subprocess.Popen(["bash", str(path)], env=env)
    time.sleep(1.5)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=30) == 75
    assert log.read_text().splitlines() == ["srun got USR1", "scontrol requeue 77"]


def test_submit_uses_sbatch(tmp_path, monkeypatch, cli_registry):
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "Submitted batch job 4242 for $1"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    res = runner.invoke(
        cli.app, ["slurm", "submit", "tiny-llama", "backend.name=fake", "--nodes", "2", "--out", str(tmp_path / "j.sh")]
    )
    assert res.exit_code == 0, res.output
    assert f"Submitted batch job 4242 for {tmp_path / 'j.sh'}" in res.output


def test_submit_without_sbatch_and_bad_config(tmp_path, monkeypatch, cli_registry):
    monkeypatch.setenv("PATH", str(tmp_path))
    res = runner.invoke(cli.app, ["slurm", "submit", "tiny-llama"])
    assert res.exit_code == 2 and "sbatch not found" in res.output
    res = runner.invoke(cli.app, ["slurm", "script", "tiny-llama", "parallel.tp=3", "--out", str(tmp_path / "x.sh")])
    assert res.exit_code == 2 and "parallel.tp" in res.output and not (tmp_path / "x.sh").exists()


def test_torchrun_command_forms():
    static = torchrun_command(["train", "c.yaml"], nproc_per_node=2, nnodes=2, node_rank=1, master_addr="h0")
    assert (
        "--node-rank=1" in static
        and "--master-addr=h0" in static
        and static[-3:] == ["primus.core.cli.app", "train", "c.yaml"]
    )
    elastic = torchrun_command(["train", "c.yaml"], nproc_per_node=8, nnodes=4, rdzv="h0:29400")
    assert "--rdzv-endpoint=h0:29400" in elastic and not any(a.startswith("--master-addr") for a in elastic)


def test_free_port_is_below_the_ephemeral_range(tmp_path, monkeypatch):
    """The rendezvous port is not one the kernel hands to outgoing connections (which took a test's port between
    its check and torchrun's bind: EADDRINUSE); where no such port is left, bind(0)'s."""
    import socket

    from primus.core.launch import env

    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    monkeypatch.setattr(env, "EPHEMERAL", ranges)
    ports = {env.free_port() for _ in range(20)}
    assert all(20000 <= p < 32768 for p in ports) and len(ports) > 1, ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free: it binds
    ranges.write_text("1024 60999\n")  # nothing below the range: the kernel's pick
    assert 1024 <= env.free_port() <= 65535
