"""Grade the exercises: `python -m exercises.grade [NN ...] [--reference] [--hint [K]]`.

The grader itself lives in exercises/grader/ (start with its __init__.py).
"""

from exercises.grader.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
