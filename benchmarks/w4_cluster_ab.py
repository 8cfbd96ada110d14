"""A / B of the cluster reduction (config CLU): ``w4_flag_ab.py --flag CLU`` (kept under this
name for the commands session 19 recorded in BENCHMARKS.md).

    python benchmarks/w4_cluster_ab.py [--rounds 3]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import w4_flag_ab  # noqa: E402

if __name__ == "__main__":
    sys.argv[1:1] = ["--flag", "CLU"]
    sys.exit(w4_flag_ab.main())
