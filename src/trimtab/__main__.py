import sys

from trimtab.cli import main

sys.exit(main())
