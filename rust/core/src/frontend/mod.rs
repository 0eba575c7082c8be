pub mod pt2;
