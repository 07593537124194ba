module hako.test/standins

go 1.21
