"""`python -m src.forecast`: the scaling predictor's command, run by `src.scaling.forecast.main` (docs/forecast.md)."""

from src.scaling.forecast import main

if __name__ == "__main__":
    main()
