from moestream.cli import main

raise SystemExit(main())
