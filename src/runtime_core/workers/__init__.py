"""The workers: one stage's compute engine behind one interface (``interface``), the
NumPy reference (``reference``), and what the quantized workers share."""
