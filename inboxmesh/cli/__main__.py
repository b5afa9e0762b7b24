import sys

from inboxmesh.cli.main import main

sys.exit(main())
