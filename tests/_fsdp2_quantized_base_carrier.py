"""Run by tests/test_distributed.py: tests/_fsdp2_quantized_base.py's check with the quantized bases' integer codes in
a floating-point carrier, as ``prepare_integer_params_for_fsdp2`` holds them for torch < 2.13, in 2 gloo processes.

    python tests/_fsdp2_quantized_base_carrier.py <free port>
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fsdp2_quantized_base import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1], carrier=True)
