import sys

from deepcompile_remat.cli import main

sys.exit(main())
