"""Datasets: the embedded MNIST (:mod:`foovb.data.mnist`) and the other vision datasets read from a data
directory (:mod:`foovb.data.datasets`)."""

from foovb.data.datasets import DATASET_NAMES, ImageDataset, download_dataset, load_dataset
from foovb.data.mnist import MNIST, MNIST_MEAN, MNIST_STD, load_mnist

__all__ = [
    "DATASET_NAMES",
    "MNIST",
    "MNIST_MEAN",
    "MNIST_STD",
    "ImageDataset",
    "download_dataset",
    "load_dataset",
    "load_mnist",
]
