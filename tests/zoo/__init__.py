"""The model zoo of issue 42: public models from transformers, diffusers, timm and torchvision on
dtorch meshes, against torch (test_zoo.py; the models in models.py, the known gaps in known_gaps.py)."""
