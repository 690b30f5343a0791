#!/usr/bin/env bash
# Session 9, run 1: where the normal-mode host path goes (cProfile), one rank.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "
import torch,time
a=torch.ones(1024,device='cuda');[a.add_(1) for _ in range(100)];torch.cuda.synchronize()
t=time.perf_counter();[a.add_(1) for _ in range(1000)];print('add_ us', (time.perf_counter()-t)*1e3)
t=time.perf_counter();[torch.empty(4096,7168,dtype=torch.bfloat16,device='cuda') for _ in range(1000)];print('empty us', (time.perf_counter()-t)*1e3)
x=torch.empty(4096,7168,dtype=torch.bfloat16,device='cuda')
t=time.perf_counter();[x.view(torch.int32) for _ in range(1000)];print('view us', (time.perf_counter()-t)*1e3)
t=time.perf_counter();[x[:4000] for _ in range(1000)];print('slice us', (time.perf_counter()-t)*1e3)
t=time.perf_counter();[x.data_ptr() for _ in range(1000)];print('data_ptr us', (time.perf_counter()-t)*1e3)
e=torch.cuda.Event();s=torch.cuda.current_stream()
t=time.perf_counter();[e.record(s) for _ in range(1000)];print('event record us', (time.perf_counter()-t)*1e3)
t=time.perf_counter();[s.wait_event(e) for _ in range(1000)];print('wait_event us', (time.perf_counter()-t)*1e3)
"
timeout 300 python3 scripts/host_path_probe.py --ranks 1 --profile --json $OUT/host.json 2>&1 | grep -v Warning | tee $OUT/host.log
