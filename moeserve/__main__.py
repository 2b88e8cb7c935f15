from moeserve.cli import main

raise SystemExit(main())
