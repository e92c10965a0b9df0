"""Training machinery over the mesh: gradient norms and clipping, loss scaling."""
