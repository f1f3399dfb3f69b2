from ladle.cli import main

raise SystemExit(main())
