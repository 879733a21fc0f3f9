"""`python -m edgeinfer.cli ...`: the same as `edgeinfer ...`."""

from edgeinfer.cli import main

raise SystemExit(main())
