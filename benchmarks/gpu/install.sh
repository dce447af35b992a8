#!/bin/bash
# On the GPU machine: install the carried wheels (.whl, from benchmarks/gpu/get-wheels.sh) without touching the
# image's torch. Begin a GPU command with:  source benchmarks/gpu/install.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1 2>/dev/null || exit 1
# bytecode once, as a user's pip install writes it: without it every process compiled ~2,300 modules again, 6 s of each
# run's start-up on the H100 (benchmarks/startup_profile.py), plain engines and Primus alike
python3 -m compileall -q -j 0 /tmp/site > /dev/null
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
echo "primus wheels built at $(cat .whl/REVISION 2>/dev/null || echo unknown)"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
