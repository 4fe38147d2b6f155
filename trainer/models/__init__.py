"""The built-in model families and pretrained weights (trainer/model.py is what every caller uses)."""
