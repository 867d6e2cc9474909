"""The named GPUs, links and clusters, each number with the public source it comes from.

Links carry what NCCL's ring reaches on the path (the bus bandwidth nccl-tests reports at
large messages) as a fraction of the specification's rate. Where no nccl-tests figure exists
for a path, the derivation from the figures that do is written beside the number. None is
fitted to end-to-end training results: the Oases paper's throughput tables are what the
simulator is checked against (``benchmarks/2026-11-30-paper-simulation``,
``benchmarks/2026-12-02-collectives``). ``planner.uncertainty`` states how far each
efficiency may be off.
"""

from __future__ import annotations

from oases.planner.clusters import GPU, Cluster, Link, Server
from oases.planner.kernels.sources import BABELSTREAM, GPU_KERNELS, STREAM_EFFICIENCY

_AMPERE = "NVIDIA Ampere GA102 GPU architecture whitepaper v2.1, table 9 (GeForce RTX 3090)"
# bf16 matmul efficiencies: the Maximum Achievable Matmul FLOPS (MAMF) table of Stas Bekman's
# "Machine Learning Engineering" ("Maximum Achievable Matmul FLOPS comparison table", BF16):
# the best mean TFLOP/s of torch.matmul over a search of shapes, one GPU, no training run.
_MAMF = (
    "https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md "
    "'Maximum Achievable Matmul FLOPS comparison table' (BF16 torch.matmul "
    "microbenchmark, best shape)"
)
MAMF_A100_SXM = 271.2 / 312  # 0.869, torch 2.6.0+cu126, 1024x10240x5120
MAMF_H100_SXM = 794.5 / 989  # 0.803, torch 2.7.0+cu126, 2048x2048x13312 ("H200 is the same")
GPUS: dict[str, GPU] = {
    "rtx3090": GPU(
        "NVIDIA GeForce RTX 3090",
        {"fp32": 35.58e12, "tf32": 35.6e12, "bf16": 71e12, "fp16": 71e12},
        24e9,
        936e9,
        0.90,
        0.82,
        f"{_AMPERE}: 35.6 TFLOP/s fp32 and tf32 dense, 71 bf16/fp16 with fp32 accumulate, "
        "24 GB GDDR6X at 936 GB/s. Efficiencies from the per-layer compute the Oases paper (Li "
        "et al., IEEE TPDS 2025) measured (H=2048, t=4: attention forward 3.24 ms, MLP forward "
        "2.69 ms), see planner.hardware. bf16/fp16 (tensor cores, fp32 accumulate: 71 "
        "TFLOP/s dense, 142 with sparsity): no public bf16 matmul microbenchmark of a GA102 "
        f"was found; the A100 SXM's ({_MAMF}: 271.2 of 312 TFLOP/s, 0.869, the same Ampere "
        "tensor-core generation) is assumed",
        compute_capability=8.6,
        dtype_efficiency={"bf16": MAMF_A100_SXM, "fp16": MAMF_A100_SXM},
        kernels=GPU_KERNELS["rtx3090"],
    ),
    "a100": GPU(
        "NVIDIA A100 SXM4 80GB",
        {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
        80e9,
        2039e9,
        0.80,
        STREAM_EFFICIENCY["a100"],
        "NVIDIA A100 Tensor Core GPU datasheet: 19.5 TFLOP/s fp32, 156 tf32, 312 bf16/fp16 "
        "dense, 80 GB HBM2e at 2039 GB/s. fp32/tf32 matmul efficiency assumed (typical large "
        f"cuBLAS GEMMs); bf16 (and fp16, the same tensor-core rate) from {_MAMF}: 271.2 of "
        f"312 TFLOP/s (0.869); memory-bound kernels at {BABELSTREAM}: triad 1724.8 of 2039 "
        "GB/s (0.846); kernels: planner.kernels.sources",
        compute_capability=8.0,
        dtype_efficiency={"bf16": MAMF_A100_SXM, "fp16": MAMF_A100_SXM},
        kernels=GPU_KERNELS["a100"],
    ),
    "h100": GPU(
        "NVIDIA H100 SXM5 80GB",
        {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
        80e9,
        3.35e12,
        0.70,
        STREAM_EFFICIENCY["h100"],
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 67 TFLOP/s fp32, 989 tf32 and 1979 "
        "bf16/fp16 with sparsity (half dense), 80 GB HBM3 at 3.35 TB/s. fp32/tf32 matmul "
        f"efficiency assumed; bf16 (and fp16) from {_MAMF}: 794.5 of 989 TFLOP/s (0.803); "
        f"memory-bound kernels at {BABELSTREAM}: triad 2.97 of 3.35 TB/s (0.887); kernels: "
        "planner.kernels.sources",
        compute_capability=9.0,
        dtype_efficiency={"bf16": MAMF_H100_SXM, "fp16": MAMF_H100_SXM},
        kernels=GPU_KERNELS["h100"],
    ),
    "h200": GPU(
        "NVIDIA H200 SXM 141GB",
        {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
        141e9,
        4.8e12,
        0.70,
        STREAM_EFFICIENCY["h200"],
        "NVIDIA H200 Tensor Core GPU datasheet (SXM): H100's compute (67 TFLOP/s fp32, 989 "
        "tf32 and 1979 bf16 with sparsity, half dense), 141 GB HBM3e at 4.8 TB/s. fp32/tf32 "
        f"matmul efficiency assumed; bf16 (and fp16) from {_MAMF}: its H100 SXM row, 794.5 of "
        f"989 TFLOP/s (0.803), which it says H200 matches; memory-bound kernels at "
        f"{BABELSTREAM}: triad 4.15 of 4.8 TB/s (0.865); kernels: H100's "
        "(planner.kernels.sources)",
        compute_capability=9.0,
        dtype_efficiency={"bf16": MAMF_H100_SXM, "fp16": MAMF_H100_SXM},
        kernels=GPU_KERNELS["h200"],
    ),
}

# -- in-server paths -----------------------------------------------------------------------------
_PCIE = "PCI-SIG base specification: {gt} GT/s x16 with 128b/130b coding = {gbs} GB/s per direction"
# PCIe 3.0 x16 GeForce pair without peer-to-peer (NCCL's SHM transport), nccl-tests at 1 GiB:
_AUTODL = (
    "https://github.com/Anthony-Hoo/Anthony-Hoo.github.io/blob/main/posts/"
    "AutoDL_Multi-GPU_Interconnection_Test.md (2x GeForce RTX 2080 Ti, PCIe Gen3 x16, "
    "peer access not supported, NCCL 2.x via "
    "host memory; nccl-tests bus bandwidth at 1 GiB: broadcast 11.09 GB/s and reduce "
    "11.14 (one staged flow), all_reduce 4.00 and all_gather 3.79 (every GPU staging both "
    "ways); p2pBandwidthLatencyTest with P2P disabled: 5.71 GB/s one way, 6.11 both)"
)
GEN3_STAGED_ONE_WAY = 11.09e9  # broadcast_perf busbw, 2 GPUs, 1 GiB (_AUTODL)
GEN3_STAGED_BOTH_WAYS = 4.00e9  # all_reduce_perf busbw, 2 GPUs, 1 GiB (_AUTODL)
# PCIe 4.0 x16 RTX 3090 pair, p2pBandwidthLatencyTest (copies staged through host memory
# with P2P off):
_CLUB3090 = (
    "https://github.com/noonghunna/club-3090/blob/main/docs/PCIE_P2P.md, 'Measured "
    "result' (2x RTX 3090, PCIe gen4 "
    "x16, p2pBandwidthLatencyTest: P2P off 11.28 GB/s one way, 16.77 both ways, "
    "15.23 us; P2P on 27.12 GB/s one way, 54.21 both ways, 1.01 us)"
)
# No nccl-tests figure of a PCIe 4.0 GeForce pair without P2P was found: its staged rates are
# the PCIe 3.0 ones scaled by how much faster the same staged copies run on PCIe 4.0
# (p2pBandwidthLatencyTest, P2P off: 11.28/5.71 one way, 16.77/6.11 both ways).
GEN4_STAGED_ONE_WAY = GEN3_STAGED_ONE_WAY * 11.28 / 5.71  # 21.9 GB/s
GEN4_STAGED_BOTH_WAYS = GEN3_STAGED_BOTH_WAYS * 16.77 / 6.11  # 11.0 GB/s
# NCCL's own NVLink model (NVIDIA/nccl src/graph/topo.h): 12 GB/s per link on sm_86 (GA102),
# 20 on sm_80, 20.6 on sm_90.
_NCCL_TOPO = "https://github.com/NVIDIA/nccl/blob/master/src/graph/topo.h"
_SJ212 = (
    "NVIDIA/nccl-tests#212, sjeaugey (NVIDIA): on H100 'NCCL can get an effective NVLink "
    "bandwidth of 370GB/s, which you can observe as BusBw when running non-allreduce "
    "operations, or when running with NCCL_ALGO=RING'; NVLink SHARP all-reduce 'peak "
    "busBw of ~480GB/s (algbw ~275GB/s)' on 8 GPUs at large sizes"
)
_SUPERBENCH = (
    "https://github.com/microsoft/superbenchmark/blob/main/tests/benchmarks/"
    "micro_benchmarks/test_cuda_nccl_bw_performance.py (nccl-tests on 8x A100-SXM4-40GB: "
    "all_reduce "
    "busbw 235.26 GB/s at 8 GiB)"
)

LINKS: dict[str, Link] = {
    "pcie3-x16-geforce": Link(
        "PCIe 3.0 x16, GeForce (no peer-to-peer: staged through host memory)",
        0.0,
        15.75e9,
        f"{_PCIE.format(gt=8, gbs=15.75)}; {_AUTODL}: one way {GEN3_STAGED_ONE_WAY / 1e9:.2f}"
        f" GB/s (efficiency 0.70), both ways {GEN3_STAGED_BOTH_WAYS / 1e9:.2f} (0.25)",
        GEN3_STAGED_ONE_WAY / 15.75e9,
        "pcie",
        True,
        GEN3_STAGED_BOTH_WAYS / 15.75e9,
    ),
    "pcie4-x16-geforce": Link(
        "PCIe 4.0 x16, GeForce (no peer-to-peer: staged through host memory)",
        0.0,
        31.5e9,
        f"{_PCIE.format(gt=16, gbs=31.5)}; the PCIe 3.0 staged bus bandwidths ({_AUTODL}) "
        f"scaled by the PCIe 4.0 / 3.0 ratio of the same staged copies ({_CLUB3090}): one way "
        f"11.09 x 11.28/5.71 = {GEN4_STAGED_ONE_WAY / 1e9:.1f} GB/s, both ways 4.00 x "
        f"16.77/6.11 = {GEN4_STAGED_BOTH_WAYS / 1e9:.1f} GB/s",
        GEN4_STAGED_ONE_WAY / 31.5e9,
        "pcie",
        True,
        GEN4_STAGED_BOTH_WAYS / 31.5e9,
    ),
    "pcie4-x16": Link(
        "PCIe 4.0 x16 (peer-to-peer)",
        0.0,
        31.5e9,
        f"{_PCIE.format(gt=16, gbs=31.5)}; {_CLUB3090}: P2P on, 27.12 GB/s one way (0.86), "
        "54.21 both ways (0.86 each)",
        27.12 / 31.5,
        "pcie",
        False,
        54.21 / 2 / 31.5,
    ),
    "nvlink-bridge-3090": Link(
        "NVLink bridge (RTX 3090 pair)",
        0.0,
        56.25e9,
        "GA102 whitepaper: four x4 NVLink links of 14.0625 GB/s per direction = 56.25 GB/s; "
        f"NCCL's model of them ({_NCCL_TOPO}: SM86_NVLINK_BW 12.0 GB/s per link) = 48 GB/s "
        "(0.853); no nccl-tests figure of a bridged 3090 pair was found",
        48 / 56.25,
        "nvlink",
        channels=4,
    ),
    "nvswitch-a100": Link(
        "NVLink 3 + NVSwitch (DGX A100)",
        0.0,
        300e9,
        f"NVIDIA A100 datasheet: NVLink 600 GB/s total per GPU (300 per direction); "
        f"{_SUPERBENCH}: 0.784; 12 channels ({_NCCL_TOPO}: 20 GB/s per channel, 12 NVLinks)",
        235.26 / 300,
        "nvlink",
        channels=12,
    ),
    "nvswitch-h100": Link(
        "NVLink 4 + NVSwitch (DGX H100/H200)",
        0.0,
        450e9,
        f"NVIDIA H100/H200 datasheets: NVLink 900 GB/s total per GPU (450 per direction); "
        f"{_SJ212}: ring 370/450 = 0.822, NVLS 480 GB/s; 18 channels (one per NVLink)",
        370 / 450,
        "nvlink",
        channels=18,
        nvls_bus_bytes_per_s=480e9,
    ),
    # -- between servers (per port); NCCL's IB and socket transports report no latency of
    # their own (src/transport/net_ib/init.cc, net_socket.cc: latency = 0): NCCL's NET row
    "10gbe": Link(
        "10 Gb Ethernet",
        0.0,
        1.25e9,
        "IEEE 802.3ae: 10 Gb/s = 1.25 GB/s; NCCL over TCP sockets: 0.6 (NVIDIA/nccl#209:"
        " 'not able to reliably obtain more than 60% of wire speed' over 32 Gb/s)",
        0.6,
        "net",
    ),
    "25gbe": Link(
        "25 Gb Ethernet",
        0.0,
        3.125e9,
        "IEEE 802.3by: 25 Gb/s = 3.125 GB/s; NCCL over TCP sockets: 0.6 (NVIDIA/nccl#209"
        ": 'not able to reliably obtain more than 60% of wire speed' over 32 Gb/s)",
        0.6,
        "net",
    ),
    "100gbe": Link(
        "100 Gb Ethernet (RoCE)",
        0.0,
        12.5e9,
        "IEEE 802.3ba/bj: 100 Gb/s = 12.5 GB/s; RDMA over Converged Ethernet: 0.75 "
        "(NVIDIA/nccl#495: two A100 servers with 8x 100 Gb RoCE NICs, 600 Gb/s "
        "all-reduce bus bandwidth, 'roughly matching our expectation' (NVIDIA)); "
        "TCP sockets reach 0.32-0.48 (NVIDIA/nccl#450: 4-6 GB/s on 100 Gb/s)",
        0.75,
        "net",
    ),
    "ib-edr": Link(
        "InfiniBand EDR 4x",
        0.0,
        12.5e9,
        "InfiniBand Trade Association roadmap: EDR 4x port 100 Gb/s = 12.5 GB/s; 0.976 "
        "(NVIDIA/nccl-tests#29, sjeaugey: '12.2 GB/s (for a 100Gbps card) is as good "
        "as you can get')",
        12.2 / 12.5,
        "net",
    ),
    "ib-hdr": Link(
        "InfiniBand HDR 4x",
        0.0,
        25e9,
        "InfiniBand Trade Association roadmap: HDR 4x port 200 Gb/s = 25 GB/s; 0.96 "
        "(NVIDIA/nccl#812, AddyLaddy: DGX-A100 with 8x 200 Gb/s IB, 'we measure "
        "192GB/s AllReduce BusBW')",
        192 / 200,
        "net",
    ),
    "ib-ndr": Link(
        "InfiniBand NDR 4x",
        0.0,
        50e9,
        "InfiniBand Trade Association roadmap: NDR 4x port 400 Gb/s = 50 GB/s; 0.97 "
        "(NVIDIA/nccl-tests#267, AddyLaddy: 'CX-7 NICs at NDR rate (400Gbps) should "
        "achieve up to 48-49GB/s per NIC')",
        48.5 / 50,
        "net",
    ),
}

_3090_PCIE = Server(4, GPUS["rtx3090"], LINKS["pcie4-x16-geforce"])
_3090_NVLINK = Server(4, GPUS["rtx3090"], LINKS["pcie4-x16-geforce"], LINKS["nvlink-bridge-3090"])
_OASES = "the Oases paper (Li et al., IEEE TPDS 2025), its evaluation"
_GEN4 = (
    "PCIe 4.0 x16 assumed (the paper says neither; the 3090 is a PCIe 4.0 card, and its "
    "profile's 32-GPU all-reduces need every hop of NCCL's ring above the 4.0 GB/s a PCIe "
    "3.0 host-staged hop reaches)"
)
_PAPER = (
    f"{_OASES}: 8 servers of 4 RTX 3090, {_GEN4}; the paper does not name the network "
    "between servers: 100 Gb Ethernet with RDMA, one port per server, is assumed (its "
    "profile's 32-GPU all-reduces are reproduced by it: benchmarks/2026-12-02-collectives)"
)
_DGX = "DGX {gpu} server: 8 GPUs on NVSwitch"
CLUSTERS: dict[str, Cluster] = {
    "rtx3090-pcie": Cluster(
        "rtx3090-pcie", 1, _3090_PCIE, source=f"{_OASES}: a server of 4 RTX 3090, {_GEN4}"
    ),
    "rtx3090-nvlink": Cluster(
        "rtx3090-nvlink",
        1,
        _3090_NVLINK,
        source=f"{_OASES}: 4 RTX 3090, NVLink bridges between pairs, {_GEN4}",
    ),
    "a100-nvlink": Cluster(
        "a100-nvlink",
        1,
        Server(8, GPUS["a100"], LINKS["nvswitch-a100"]),
        source=_DGX.format(gpu="A100"),
    ),
    "h100-nvlink": Cluster(
        "h100-nvlink",
        1,
        Server(8, GPUS["h100"], LINKS["nvswitch-h100"]),
        source=_DGX.format(gpu="H100"),
    ),
    "h200-nvlink": Cluster(
        "h200-nvlink",
        1,
        Server(8, GPUS["h200"], LINKS["nvswitch-h100"]),
        source=_DGX.format(gpu="H200"),
    ),
    "paper-3090-pcie-32": Cluster(
        "paper-3090-pcie-32", 8, _3090_PCIE, LINKS["100gbe"], source=_PAPER
    ),
    "paper-3090-nvlink-32": Cluster(
        "paper-3090-nvlink-32", 8, _3090_NVLINK, LINKS["100gbe"], source=_PAPER
    ),
    "a100-ib-64": Cluster(
        "a100-ib-64",
        8,
        Server(8, GPUS["a100"], LINKS["nvswitch-a100"]),
        LINKS["ib-hdr"],
        8,
        "8 DGX A100, one 200 Gb/s HDR port per GPU (8 per server)",
    ),
    "h100-ib-64": Cluster(
        "h100-ib-64",
        8,
        Server(8, GPUS["h100"], LINKS["nvswitch-h100"]),
        LINKS["ib-ndr"],
        8,
        "8 DGX H100, one 400 Gb/s NDR port per GPU (8 per server)",
    ),
    "h200-ib-64": Cluster(
        "h200-ib-64",
        8,
        Server(8, GPUS["h200"], LINKS["nvswitch-h100"]),
        LINKS["ib-ndr"],
        8,
        "8 DGX H200, one 400 Gb/s NDR port per GPU (8 per server)",
    ),
}
