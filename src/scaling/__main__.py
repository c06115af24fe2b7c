"""`python -m src.scaling`: the scaling report (`src.scaling_report`)."""

from src.scaling_report import main

if __name__ == "__main__":
    main()
