"""`python -m netagent`: the command line (`cli.main`). The one arrow that runs up the layers,
declared in the import-linter contracts: a launcher, not part of the agent."""
import sys

from cli.main import main

sys.exit(main())
