import sys

from exercises.grader.cli import main

sys.exit(main())
