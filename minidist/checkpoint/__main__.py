"""`python -m minidist.checkpoint DIR`: each checkpoint intact, or damaged and where. Chapter 08."""
from minidist.checkpoint.io import main

if __name__ == "__main__":
    main()
