import sys

from egressd.main import main

sys.exit(main())
