"""`python -m src.scaling`: the scaling report (`src.scaling.report`)."""

from src.scaling.report import main

if __name__ == "__main__":
    main()
