"""Datasets: the embedded MNIST (:mod:`foovb_suite.data.mnist`) and the other vision datasets read from a data
directory (:mod:`foovb_suite.data.datasets`; their file formats' readers: :mod:`foovb_suite.data.formats`)."""

from foovb_suite.data.datasets import DATASET_NAMES, ImageDataset, dataset_folders, download_dataset, load_dataset
from foovb_suite.data.mnist import MNIST, MNIST_MEAN, MNIST_STD, DataFileError, load_mnist

__all__ = [
    "DATASET_NAMES",
    "MNIST",
    "MNIST_MEAN",
    "MNIST_STD",
    "DataFileError",
    "dataset_folders",
    "ImageDataset",
    "download_dataset",
    "load_dataset",
    "load_mnist",
]
