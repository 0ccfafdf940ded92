#!/usr/bin/env bash
# The environment line of the Hopper device runs (GPU, driver, clocks, power limit; torch, triton,
# cuDNN): bash benchmarks/hopper_env.sh > OUT/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cudnn", torch.backends.cudnn.version())'
