"""`python -m src.forecast`: the scaling predictor's command; the code is in `src.scaling.forecast` (docs/forecast.md)."""

from src.scaling.forecast import main

if __name__ == "__main__":
    main()
