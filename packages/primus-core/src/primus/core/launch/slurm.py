"""Slurm: an sbatch script that runs ``primus train`` through torchrun on every node (one srun task per
node, c10d rendezvous on the first node), with the launch environment of :mod:`primus.core.launch.env`.

Preemption and time limits: Slurm sends the batch shell SIGUSR1 ``signal_grace_s`` seconds before the time limit
(``--signal=B:USR1@N``); the script passes it to the job step, where torchrun forwards it to every worker
(``PET_SIGNALS_TO_HANDLE``) and waits for them (``PET_SHUTDOWN_TIMEOUT``): they finish the step, commit one
checkpoint and exit (:mod:`primus.core.run.stop`). The script then requeues the job (``--requeue``), and the requeued
job resumes from that checkpoint (``checkpoint.resume=auto``; on the first start there is none and it starts
fresh). A preemption Slurm itself requeues sends SIGTERM to every process, handled the same way within
Slurm's KillWait."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from primus.core.launch.env import SITE_SPECIFIC, defaults
from primus.core.run.stop import TORCHRUN_SIGNALS


@dataclass
class SlurmJob:
    config: str
    overrides: list[str]
    nodes: int
    gpus_per_node: int
    family: str = "nvidia"
    job_name: str = "primus"
    time: str = "24:00:00"
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    output_dir: str = "."
    rdzv_port: int = 29500
    env: dict[str, str] = field(default_factory=dict)
    python: str = "python3"
    signal_grace_s: int = 300  # SIGUSR1 this long before the time limit: the time to finish a step and save


def script(job: SlurmJob) -> str:
    sb = [
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={job.gpus_per_node}",
        f"#SBATCH --time={job.time}",
        f"#SBATCH --output={job.output_dir}/slurm-%j.out",
        "#SBATCH --exclusive",
        f"#SBATCH --signal=B:USR1@{job.signal_grace_s}",
        "#SBATCH --requeue",
    ]
    if job.cpus_per_task:
        sb.append(f"#SBATCH --cpus-per-task={job.cpus_per_task}")
    if job.partition:
        sb.append(f"#SBATCH --partition={job.partition}")
    if job.account:
        sb.append(f"#SBATCH --account={job.account}")
    env_lines = [f"# launch environment for {job.family} GPUs (primus/core/launch/env.py); set values win"]
    for key, (value, why) in defaults(job.family).items():
        if key not in job.env:
            env_lines.append(f"export {key}=${{{key}:-{shlex.quote(value)}}}  # {why}")
    for key, value in job.env.items():
        env_lines.append(f"export {key}={shlex.quote(value)}  # --env")
    env_lines += [f"# export {k}=...  # site-specific: set for this cluster" for k in SITE_SPECIFIC if k not in job.env]
    train = [
        job.python,
        "-m",
        "torch.distributed.run",
        "--nnodes=$SLURM_NNODES",
        f"--nproc-per-node={job.gpus_per_node}",
        "--rdzv-id=$SLURM_JOB_ID",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=$head:{job.rdzv_port}",
        "-m",
        "primus.core.cli.app",
        "train",
        shlex.quote(job.config),
        "checkpoint.resume=auto",  # a requeued job continues from its newest checkpoint (yours, after it, win)
        *map(shlex.quote, job.overrides),
    ]
    return "\n".join(
        [
            "#!/bin/bash",
            *sb,
            "# Written by `primus slurm script`: one srun task per node, each running torchrun for its GPUs.",
            "set -euo pipefail",
            *env_lines,
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "export PRIMUS_LAUNCHED=1",
            "# torchrun forwards SIGUSR1 to the workers and gives them this long to save before it kills them",
            f"export PET_SIGNALS_TO_HANDLE={TORCHRUN_SIGNALS}",
            f"export PET_SHUTDOWN_TIMEOUT=${{PET_SHUTDOWN_TIMEOUT:-{job.signal_grace_s}}}",
            "requeue=0",
            "trap 'requeue=1; kill -USR1 \"$srun_pid\" 2>/dev/null' USR1  # the time limit is near",
            "set +e",
            "srun --kill-on-bad-exit=1 --ntasks-per-node=1 " + " ".join(train) + " &",
            "srun_pid=$!",
            'while true; do wait "$srun_pid"; rc=$?; kill -0 "$srun_pid" 2>/dev/null || break; done',
            'if [ "$requeue" = 1 ]; then scontrol requeue "$SLURM_JOB_ID"; fi  # continues from the checkpoint',
            'exit "$rc"',
            "",
        ]
    )


def write(job: SlurmJob, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script(job))
    path.chmod(0o755)
    return path
