"""`python -m twinkle.server ...` is the same as `twinkle-server ...`."""

from twinkle.server.cli import main

raise SystemExit(main())
