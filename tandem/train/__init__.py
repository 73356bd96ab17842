"""Training: self-distillation data, SpecFormer head, small draft model (the predictor trains in
``tandem.predictor``)."""
