import sys

from dcr_bench.cli import main

sys.exit(main())
