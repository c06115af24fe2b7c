"""`python -m src.forecast`: the scaling predictor's command, run by `src.scaling.predictor.main` (docs/forecast.md)."""

from src.scaling.predictor import main

if __name__ == "__main__":
    main()
