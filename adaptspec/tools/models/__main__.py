from adaptspec.tools.models import main

raise SystemExit(main())
