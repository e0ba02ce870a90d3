"""``python -m bcp_core``: the ``bcp`` command, for where another ``bcp`` (SQL Server's bulk-copy
tool) comes first on PATH. Same arguments, output and exit status."""

from bcp_core.tools.cli import main

raise SystemExit(main())
