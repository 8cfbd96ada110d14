"""Test-wide settings."""
import torch

# The test models are tiny: intra-op threads only add spin/wake overhead, and on
# a loaded 2-core machine they make small ops 10x slower.
torch.set_num_threads(1)
