from relay.admin.cli import main

raise SystemExit(main())
