"""The calibrated conversion: calibration text, decoder layers, the layer loop (loop.py), one layer's passes (layer.py), statistics, rounding, resume state, ranks."""
