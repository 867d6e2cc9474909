"""Write the H200 preset (planner/presets.py, from datasheets and published microbenchmarks) as a
one-GPU cluster file on the measured file's placeholder link, so `oases simulate` prices the same
one-GPU step with the preset's kernel model as with the measured one.

    python preset_cluster.py kernels/h200-bf16.json kernels/h200-preset-1gpu.json
"""

import dataclasses
import sys
from pathlib import Path

from oases.bench.kernel_profile import write_kernel_profile
from oases.planner.clusters import load_cluster
from oases.planner.presets import GPUS

measured = load_cluster(Path(sys.argv[1]))
preset = dataclasses.replace(
    measured,
    name="h200-preset-1gpu",
    server=dataclasses.replace(measured.server, gpu=GPUS["h200"]),
    source="the h200 preset on the measured file's placeholder link (preset_cluster.py)",
)
write_kernel_profile(preset, Path(sys.argv[2]))
