"""Small complete graphdist programs (installed as graphdist.examples; used by the demo)."""
