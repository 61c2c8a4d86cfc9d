"""`python -m server serve ...` is `radixgen serve ...`."""

import sys

from server.cli import main

sys.exit(main())
