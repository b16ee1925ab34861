"""Fault healing: every injected fault with the orchestrator off and in auto (the same as
`trimtab bench healing`; the code is trimtab.orchestrator.healing).

    python bench/healing.py [--preset debug] [--steps 120] [--scenarios nan_loss,oom] [--json PATH]
"""

import sys

from trimtab.orchestrator import healing

if __name__ == "__main__":
    sys.exit(healing.main(sys.argv[1:]))
